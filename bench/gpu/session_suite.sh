#!/usr/bin/env bash
# One device call for several issues' GPU runs, each under its own time limit, outputs in $OUT:
#   run(command="SUITE='tonp engine trainer fp8' bash bench/gpu/session_suite.sh", carry=[".wheels-lead"])
set -u
OUT="${OUT:-/tmp/out}"
SUITE="${SUITE:-tonp engine trainer fp8}"
mkdir -p "$OUT" /tmp/deps /tmp/pkg
pip install -q --no-index --no-deps --target /tmp/deps .wheels-lead/*.whl > /tmp/install.log 2>&1
ln -sfn "$PWD" /tmp/pkg/miles
export PYTHONPATH="/tmp/pkg:/tmp/deps:${PYTHONPATH:-}"
export NCCL_NVLS_ENABLE=0 MILES_CACHE=/tmp/miles-cache
STEP_DIR="$OUT"
# shellcheck source=bench/suite_step.sh
source bench/suite_step.sh
PYTEST=(python -m pytest -q -p no:cacheprovider --import-mode=importlib -o addopts= -m gpu)
for s in $SUITE; do
  case "$s" in
    tonp) step true_on_policy_gpu_tests_h200 120 "${PYTEST[@]}" tests/models/test_models_invariant_triton.py \
            tests/recipes/test_recipes_true_on_policy.py tests/models/test_models_deepseek_v3_glm4_moe.py
          step true_on_policy_h200 100 python bench/true_on_policy.py --device cuda --archs qwen3,qwen3_moe ;;
    engine) step engine_h200 ${ENGINE_S:-170} python bench/engine.py --device cuda ${ENGINE_ARGS:-} ;;
    trainer) step trainer_h200 ${TRAINER_S:-130} python bench/trainer.py --device cuda --seqs 1024,2048,4096 \
            --step-tokens 32768 --micro-tokens 16384 --steps 3 --baseline ${TRAINER_ARGS:-} ;;
    fp8) step fp8_gpu_tests_h200 50 "${PYTEST[@]}" tests/models/test_models_fp8.py
         step fp8_gemm_h200 60 python bench/gpu/fp8_gemm.py --device cuda --parts gemm,sync --batches 16,256 \
            --repeats 30 --out "$OUT/fp8_gemm_h200.json"
         step fp8_engine_h200 60 python bench/gpu/fp8_gemm.py --device cuda --parts engine --batch 256 --new 64 \
            --repeats 30 --out "$OUT/fp8_engine_h200.json"
         step fp8_logprob_gap_h200 40 python bench/gpu/fp8_logprob_gap.py --device cuda \
            --out "$OUT/fp8_logprob_gap_h200.json" ;;
    *) echo "unknown suite step $s" >&2 ;;
  esac
done
exit 0
