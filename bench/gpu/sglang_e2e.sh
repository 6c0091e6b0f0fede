#!/usr/bin/env bash
# Issue 35 on one H200: launched `miles train` runs with engine.type = "sglang" (bench/gpu/sglang_e2e.py).
# Not run yet. The last call of the SGLang recipe (bench/gpu/README.md: 8 transfer calls of .wheels/pN
# first, then this one, which joins and installs the wheels unless the machine has them):
#   run(command="MILES_COMMIT=<sha> bash bench/gpu/sglang_e2e.sh", carry=[".wheels/p8"], timeout_s=600)
# CASES / STEPS / LIMIT_S override the defaults; a second call on the warm machine runs what the first
# left out, e.g. CASES=dense-disk,qs-sglang-1,qs-torch-1.
# Output under $OUT: sglang_e2e_h200.json (rewritten after every case), sglang_e2e.txt (table + JSON line).
set -u
OUT="${OUT:-/tmp/out}"
# shellcheck source=bench/gpu/sglang_install.sh
source bench/gpu/sglang_install.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
CASES="${CASES:-qs-sglang-0,dense-tensor,moe-tensor,qs-torch-0,dense-disk,qs-sglang-1,qs-torch-1}"
timeout "${LIMIT_S:-560}" python3 bench/gpu/sglang_e2e.py --cases "$CASES" --steps "${STEPS:-0}" \
  --limit-s "$(( ${LIMIT_S:-560} - 150 ))" --out "$OUT/sglang_e2e_h200.json" --keep-logs /tmp/e2e-logs 2>&1 | tee "$OUT/sglang_e2e.txt"
(cd /tmp && tar czf "$OUT/e2e_logs.tgz" e2e-logs 2>/dev/null)
exit 0
