#!/usr/bin/env bash
# Final device call of the SGLang recipe (bench/gpu/README.md): join the carried tar chunks,
# install the wheels into /tmp/sgl-site, make the checkout importable as `miles`, run the check.
#   run(command="bash bench/gpu/run_sglang_h200.sh", carry=[".wheels/p8"])
set -u
OUT="${OUT:-/tmp/out}"
# shellcheck source=bench/gpu/sglang_install.sh
source bench/gpu/sglang_install.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 520 python3 bench/gpu/sglang_h200.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
cp /tmp/miles-sglang-bench/server.log "$OUT/server.log" 2>/dev/null
exit 0
