#!/usr/bin/env bash
# The H200 benchmark/test suite, run through the device tool in one call:
#   run(command="bash bench/h200_suite.sh", carry=[".wheels-lead"])
# Installs the carried cp312 wheels (the device has no internet), makes the checkout importable
# as `miles`, then runs each GPU measurement with its own time limit; outputs land in $OUT.
set -u
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT" /tmp/deps /tmp/pkg
pip install -q --no-index --no-deps --target /tmp/deps .wheels-lead/*.whl > /tmp/install.log 2>&1
ln -sfn "$PWD" /tmp/pkg/miles
export PYTHONPATH="/tmp/pkg:/tmp/deps:${PYTHONPATH:-}"
export NCCL_NVLS_ENABLE=0
# At most 8 files come back from $OUT: the GPU line goes to stderr (the call's output tail).
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >&2
STEP_DIR="$OUT"
# shellcheck source=bench/suite_step.sh
source bench/suite_step.sh
step engine_h200 120 python bench/engine.py --device cuda --repeats 3
step trainer_h200 120 python bench/trainer.py --device cuda
step true_on_policy_h200 60 python bench/true_on_policy.py --device cuda
step cuda_ipc_test 60 python -m pytest -q -p no:cacheprovider --import-mode=importlib tests/sync/test_sync_optional.py
step perftest_cuda_ipc 90 python -m miles.launch.cli perftest --transport cuda-ipc --pattern stream \
  --sizes 8B:512MiB:x8 --json "$OUT/perftest_h200_cuda_ipc.json" --csv "$OUT/perftest_h200_cuda_ipc.csv"
exit 0
