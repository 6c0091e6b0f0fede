# Sourced by the last call of the SGLang recipe (sglang_e2e.sh, run_sglang_h200.sh,
# engine_vs_sglang.sh; bench/gpu/README.md): joins the chunks earlier calls kept in /root/carry
# (bench/gpu/carry.sh) plus the one this call carries, checks their sha256 and installs the wheels
# into /tmp/sgl-site. A warm machine that has the install skips all of it.
mkdir -p "$OUT" /tmp/pkg
if [ ! -d /tmp/sgl-site/sglang ]; then
  bash bench/gpu/carry.sh join || { echo "join failed"; ls -la /root/carry; exit 3; }
  t0=$(date +%s)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sgl-site \
    /root/sglw/whl/*.whl > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 4; }
  echo "install: $(( $(date +%s) - t0 )) s"
fi
ln -sfn "$PWD" /tmp/pkg/miles
export PYTHONPATH="/tmp/sgl-site:/tmp/pkg:${PYTHONPATH:-}" SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 PYTHONUNBUFFERED=1
