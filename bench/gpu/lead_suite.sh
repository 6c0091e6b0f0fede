#!/usr/bin/env bash
# One device call, several GPU measurements, each under its own time limit (bench/suite_step.sh):
#   run(command="SUITE='e2e fp8 tests' bash bench/gpu/lead_suite.sh", carry=[".wheels-lead"])
# .wheels-lead: cp312 wheels the image lacks (bench/gpu/e2e_suite.sh names them). Outputs in $OUT.
set -u
OUT="${OUT:-/tmp/out}"
SUITE="${SUITE:-e2e tests fp8}"
mkdir -p "$OUT" /tmp/deps /tmp/pkg
pip install -q --no-index --no-deps --target /tmp/deps .wheels-lead/*.whl > /tmp/install.log 2>&1
ln -sfn "$PWD" /tmp/pkg/miles
export PYTHONPATH="/tmp/pkg:/tmp/deps:${PYTHONPATH:-}"
export NCCL_NVLS_ENABLE=0 MILES_CACHE=/tmp/miles-cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >&2
STEP_DIR="$OUT"
# shellcheck source=bench/suite_step.sh
source bench/suite_step.sh
PYTEST=(python -m pytest -q -p no:cacheprovider --import-mode=importlib -o addopts= -m gpu)
for s in $SUITE; do
  case "$s" in
    e2e) step e2e_gpu_h200 330 python bench/e2e_gpu.py --device cuda --cases "${E2E_CASES:-dense,moe,moe-sync}" \
           --steps "${E2E_STEPS:-12}" --out "$OUT/e2e_gpu_h200.json" ${E2E_SETS:-} ;;
    e2e-async) step e2e_async_h200 210 python bench/e2e_gpu.py --device cuda --cases moe,moe-sync \
           --steps 16 --out "$OUT/e2e_async_h200.json" ${ASYNC_SETS:-} ;;
    async-mps)  # the same fully_async vs sync pair with the MPS daemon up (engine and trainer
      # kernels then run concurrently instead of time-slicing the GPU between the two processes)
      nvidia-cuda-mps-control -d && echo "MPS daemon started" >&2
      step e2e_async_mps_h200 330 python bench/e2e_gpu.py --device cuda --cases "${MPS_CASES:-moe,moe-sync}" \
           --steps 16 --out "$OUT/e2e_async_mps_h200.json" ${ASYNC_SETS:-}
      echo quit | nvidia-cuda-mps-control ;;
    tests) step gpu_tests_h200 150 "${PYTEST[@]}" tests/sync/test_sync_publisher.py ${GPU_TESTS:-} ;;
    trainer) step trainer_h200 240 python bench/trainer.py --device cuda ;;
    fp8) step fp8_gemm_h200 200 python bench/gpu/fp8_gemm.py --device cuda --out "$OUT/fp8_gemm_h200.json" ;;
    mla) step mla_decode_h200 150 python bench/mla_decode.py --device cuda --layers 4 --batch 32 --prompt 512 \
           --new 128 ;;
    models) step models_gpu_tests_h200 200 "${PYTEST[@]}" tests/models ;;
    tonp) step true_on_policy_gpu_tests_h200 240 "${PYTEST[@]}" tests/models/test_models_invariant_triton.py \
            tests/recipes/test_recipes_true_on_policy.py tests/models/test_models_deepseek_v3_glm4_moe.py
          step true_on_policy_h200 240 python bench/true_on_policy.py --device cuda --archs qwen3,qwen3_moe ;;
    trainer27) step trainer_h200_s7 450 python bench/trainer.py --device cuda --seqs "${TRAINER_SEQS:-1024,4096}" \
           --before --profile ${TRAINER_ARGS:-} ;;
    async19)  # fully_async variants against sync at its defaults, one run each, same call
      step e2e_async_h200_s7 560 python bench/e2e_gpu.py --device cuda --steps 16 --out "$OUT/e2e_async_h200_s7.json" \
           --cases "${ASYNC_CASES:-moe-sync,moe,moe@trainer.pause_engines=true}" ;;
    async19-mps)  # the same with the MPS daemon up and the engine held to a share of the SMs
      nvidia-cuda-mps-control -d && echo "MPS daemon started" >&2
      step e2e_async_mps_h200_s7 560 python bench/e2e_gpu.py --device cuda --steps 16 \
           --out "$OUT/e2e_async_mps_h200_s7.json" --cases "${MPS_CASES:-moe-sync,moe@engine.mps_thread_percent=40}"
      echo quit | nvidia-cuda-mps-control ;;
    engine21)  # the engine's GPU tests (paged KV vs rows with and without graphs, batched sampling,
      # compiled decode) and the paged pool's tok/s and KV memory against rows
      step engine_gpu_tests_h200 240 "${PYTEST[@]}" tests/engines/test_engines_paged_kv.py \
           tests/engines/test_engines_sampling.py tests/engines/test_engines_compiled_decode.py
      step paged_kv_h200 240 python bench/paged_kv.py --device cuda --out "$OUT/paged_kv_h200.json" ;;
    trainer27moe)  # the small MoE only: profile, compiled blocks, then 32k-token micro-batches
      step trainer_moe_h200_s8 300 python bench/trainer.py --device cuda --models moe_small --seqs 1024,4096 \
           --profile --compile
      step trainer_moe_mb32k_h200_s8 200 python bench/trainer.py --device cuda --models moe_small \
           --seqs 1024,4096 --micro-tokens 32768 ;;
    mps19)  # why the engine sampled NaN under engine.mps_thread_percent=40: ops and a forward, with
      # and without the SM limit, then the e2e case without CUDA graphs
      nvidia-cuda-mps-control -d && echo "MPS daemon started" >&2
      step mps_probe_full_h200 120 python bench/gpu/mps_probe.py
      step mps_probe_40_h200 120 env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40 python bench/gpu/mps_probe.py
      [ -n "${MPS_PROBE_ONLY:-}" ] || step e2e_mps40_nographs_h200 200 python bench/e2e_gpu.py --device cuda --steps 8 \
           --out "$OUT/e2e_mps40_nographs_h200.json" --cases "${MPS_CASES:-moe@engine.mps_thread_percent=40@engine.cuda_graphs=false}"
      echo quit | nvidia-cuda-mps-control ;;
    final8)  # the fused-dispatch change on the GPU (grouped MoE tests), the engine's MPS GEMM check
      # refusing at start, then fully_async vs sync on the final code
      step grouped_moe_gpu_tests_h200_s8 150 "${PYTEST[@]}" tests/models/test_models_grouped_moe.py -m "gpu or not gpu" \
           tests/engines/test_engines_mps_check.py
      nvidia-cuda-mps-control -d && echo "MPS daemon started" >&2
      step e2e_mps40_refused_h200_s8 120 python bench/e2e_gpu.py --device cuda --steps 2 \
           --out "$OUT/e2e_mps40_refused_h200_s8.json" --cases "moe@engine.mps_thread_percent=40"
      echo quit | nvidia-cuda-mps-control
      step e2e_async_h200_s8 240 python bench/e2e_gpu.py --device cuda --steps 16 --out "$OUT/e2e_async_h200_s8.json" \
           --cases moe-sync,moe ;;
    engine21b)  # overlap_decode + compile_decode (the new defaults): the engine's GPU tests, tok/s
      # against the plain graphs (neither), then where the decode time goes now
      step engine_gpu_tests_h200_s9 240 "${PYTEST[@]}" tests/engines/test_engines_overlap.py \
           tests/engines/test_engines_compiled_decode.py tests/engines/test_engines_sampling.py \
           tests/engines/test_engines_paged_kv.py
      step engine_h200_s9 330 python bench/engine.py --device cuda --models dense,moe --cases b32,b128 --hf "" \
           --plain-cases dense:b128,moe:b128 --repeats 3 --budget-s 15 --out "$OUT/engine_h200_s9.json"
      step decode_profile_h200_s9 150 python bench/gpu/decode_profile.py --models dense,moe --cases b128 --top 15 ;;
    perf38)  # issue 38 in one call (~570 s): the background decode compile's GPU test, then the time
      # to first step from cold compile caches with it (engine.compile_background, off by default since
      # 13c0eff, so COLD_SETS sets it; COLD_SETS="--set engine.compile_background=false" gives the
      # blocking compile for comparison), dense 1.3B then MoE, then the trainer's MFU at the goal pack
      # sizes: MoE at 32k, dense at 16k
      step engine_bg_compile_gpu_tests_h200_s38 80 "${PYTEST[@]}" tests/engines/test_engines_compiled_decode.py
      for c in dense moe; do
        step "cold_start_${c}_h200_s38" "$([ "$c" = dense ] && echo 150 || echo 110)" \
             env TORCHINDUCTOR_CACHE_DIR="/tmp/cold38-$c/inductor" TRITON_CACHE_DIR="/tmp/cold38-$c/triton" \
             python bench/e2e_gpu.py --device cuda --cases "$c" --steps 3 --out "$OUT/cold_start_${c}_h200_s38.json" \
             ${COLD_SETS:---set engine.compile_background=true}
      done
      step trainer_moe_mb32k_h200_s38 110 python bench/trainer.py --device cuda --models moe_small --seqs 1024,4096 \
           --micro-tokens 32768 ${TRAINER38_ARGS:-}
      step trainer_dense_mb16k_h200_s38 100 python bench/trainer.py --device cuda --models dense_0.5b --seqs 1024,4096 \
           --micro-tokens 16384 ${TRAINER38_ARGS:-} ;;
    *) echo "unknown suite step $s" >&2 ;;
  esac
done
exit 0
