#!/usr/bin/env bash
# Final device call of the SGLang recipe (bench/gpu/README.md): join the carried tar chunks,
# install the wheels into /tmp/sgl-site, make the checkout importable as `miles`, run the check.
#   run(command="bash bench/gpu/run_sglang_h200.sh", carry=[".wheels/p7"])
set -u
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT" /root/sglw /tmp/pkg
if [ ! -d /tmp/sgl-site/sglang ]; then  # a warm machine keeps the install of the previous call
cp .wheels/p7/* /root/sglw/
cd /root/sglw && cat c.0 c.1 c.2 c.3 c.4 c.5 c.6 c.7 > sglw.tar && sed -i "s|/tmp/sglw.tar|sglw.tar|" sglw.sha && sha256sum -c sglw.sha | sed "s|^|sha: |" \
  && mkdir -p whl && tar xf sglw.tar -C whl && rm -f c.* sglw.tar || { echo "join failed"; ls -la; exit 3; }
cd - > /dev/null
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sgl-site /root/sglw/whl/*.whl \
  > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 4; }
echo "install: $(( $(date +%s) - t0 )) s"
fi
ln -sfn "$PWD" /tmp/pkg/miles
export PYTHONPATH="/tmp/sgl-site:/tmp/pkg" SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 520 python3 bench/gpu/sglang_h200.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
cp /tmp/miles-sglang-bench/server.log "$OUT/server.log" 2>/dev/null
exit 0
