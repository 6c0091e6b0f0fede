#!/usr/bin/env bash
# VLM measurements on one H200 (prepared; not run in the session that wrote it):
#   run(command="bash bench/gpu/vlm_suite.sh", carry=[".wheels-lead"])
# 1. engine generation with images vs text-only at the same token count (bench/vlm_decode.py:
#    Qwen2.5-VL-3B's tower over a Qwen2.5-0.5B-shaped language side, bf16, random weights);
# 2. the family's tests on the GPU (parity, engine with images, token exactness);
# 3. the VLM recipe on the GPU (bench/vlm_cpu.py with engine/trainer on cuda).
set -u
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT" /tmp/deps /tmp/pkg
pip install -q --no-index --no-deps --target /tmp/deps .wheels-lead/*.whl > /tmp/install.log 2>&1
ln -sfn "$PWD" /tmp/pkg/miles
export PYTHONPATH="/tmp/pkg:/tmp/deps:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >&2
STEP_DIR="$OUT"
# shellcheck source=bench/suite_step.sh
source bench/suite_step.sh
step vlm_decode_h200_b32 300 python bench/vlm_decode.py --device cuda --shape 3b --batch 32 --new 128
step vlm_decode_h200_b128 300 python bench/vlm_decode.py --device cuda --shape 3b --batch 128 --new 128
step vlm_tests_h200 300 python -m pytest -q -p no:cacheprovider --import-mode=importlib \
  tests/models/test_models_qwen2_5_vl.py tests/engines/test_engines_vl.py tests/trainer/test_trainer_vl_token_exact.py
step vlm_recipe_h200 600 python bench/vlm_cpu.py --name vlm_h200 --set engine.device=cuda --set trainer.device=cuda
exit 0
