#!/usr/bin/env bash
# The session's last device call: true on-policy GPU tests, the engine bench, the trainer bench and
# the FP8 runs, each under its own limit, few output files (the device returns at most 8):
#   run(command="bash bench/gpu/final_suite.sh", carry=[".wheels-lead"], timeout_s=590)
set -u
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT" /tmp/deps /tmp/pkg
pip install -q --no-index --no-deps --target /tmp/deps .wheels-lead/*.whl > /tmp/install.log 2>&1
ln -sfn "$PWD" /tmp/pkg/miles
export PYTHONPATH="/tmp/pkg:/tmp/deps:${PYTHONPATH:-}" NCCL_NVLS_ENABLE=0 MILES_CACHE=/tmp/miles-cache
PYTEST=(python -m pytest -q -p no:cacheprovider --import-mode=importlib -o addopts= -m gpu --tb=short -rf)
quiet() { grep -v '^{"\|DEBUG\|Loading weights' ; }
{ echo "== $(git rev-parse --short HEAD 2>/dev/null) true on-policy + engine GPU tests"
  timeout 80 "${PYTEST[@]}" tests/models/test_models_invariant_triton.py tests/recipes/test_recipes_true_on_policy.py \
    tests/models/test_models_deepseek_v3_glm4_moe.py tests/engines/test_engines_sampling.py \
    tests/engines/test_engines_compiled_decode.py 2>&1 | quiet | tail -40; } > "$OUT/gpu_tests.txt"
tail -3 "$OUT/gpu_tests.txt" >&2
timeout 170 python bench/engine.py --device cuda ${ENGINE_ARGS:-} 2>&1 | quiet > "$OUT/engine_h200.txt"
tail -14 "$OUT/engine_h200.txt" >&2
timeout 140 python bench/trainer.py --device cuda --seqs 1024,4096 --step-tokens 32768 --micro-tokens 16384 \
  --steps 3 --baseline --compile 2>&1 | quiet > "$OUT/trainer_h200.txt"
tail -16 "$OUT/trainer_h200.txt" >&2
{ echo "== fp8 GPU tests"; timeout 45 "${PYTEST[@]}" tests/models/test_models_fp8.py 2>&1 | quiet | tail -30
  echo "== fp8 engine"; timeout 60 python bench/gpu/fp8_gemm.py --device cuda --parts engine --batch 256 --new 64 \
    --repeats 30 --out "$OUT/fp8_engine_h200.json" 2>&1 | quiet | tail -c 3000
  echo "== fp8 logprob gap"; timeout 60 python bench/gpu/fp8_logprob_gap.py --device cuda \
    --out "$OUT/fp8_logprob_gap_h200.json" 2>&1 | quiet | tail -c 4000; } > "$OUT/fp8_h200.txt"
tail -12 "$OUT/fp8_h200.txt" >&2
exit 0
