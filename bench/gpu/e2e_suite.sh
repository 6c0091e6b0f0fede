#!/usr/bin/env bash
# Launched `miles train` runs on one H200 through the device tool, in one call:
#   run(command="bash bench/gpu/e2e_suite.sh [CASES] [STEPS] [EXTRA --set ...]", carry=[".wheels-lead"])
# .wheels-lead: cp312 wheels of what miles imports that the image lacks (pyzmq, structlog, xxhash,
# lz4, aiohttp and its deps, pytest-asyncio, pytest-timeout). Results land in $OUT.
set -u
OUT="${OUT:-/tmp/out}"
CASES="${1:-dense,moe,moe-sync}"
STEPS="${2:-12}"
shift 2 2>/dev/null || shift $#
mkdir -p "$OUT" /tmp/deps /tmp/pkg
pip install -q --no-index --no-deps --target /tmp/deps .wheels-lead/*.whl > "$OUT/install.log" 2>&1
ln -sfn "$PWD" /tmp/pkg/miles
export PYTHONPATH="/tmp/pkg:/tmp/deps:${PYTHONPATH:-}"
export NCCL_NVLS_ENABLE=0 MILES_CACHE=/tmp/miles-cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >&2
git log --oneline -1 > "$OUT/commit.txt" 2>/dev/null || true
python bench/e2e_gpu.py --device cuda --cases "$CASES" --steps "$STEPS" --out "$OUT/e2e_gpu_h200.json" \
  --keep /tmp/e2e-runs "$@" 2>&1 | tee "$OUT/e2e_gpu_h200.txt" | tail -40
for d in /tmp/e2e-runs/*/; do  # the trainer's per-step console lines and any errors, per case
  n=$(basename "$d"); tail -30 "$d/logs/trainer-0.out" > "$OUT/${n}_trainer.txt" 2>/dev/null
  grep -h '"level": "error"\|"level": "warning"' "$d"/logs/*.log 2>/dev/null | grep -v event_loop_lag | tail -20 >> "$OUT/${n}_trainer.txt"
done
exit 0
