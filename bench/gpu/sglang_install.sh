# Sourced by the last call of the SGLang recipe (run_sglang_h200.sh, engine_vs_sglang.sh;
# bench/gpu/README.md): join the tar chunks earlier calls left in /root/sglw plus the one this call
# carries (.wheels/pN: the last chunk and the sha; .wheels/ itself is not in the tree), check the
# sha256, install into /tmp/sgl-site. A warm machine that has the install skips all of it.
mkdir -p "$OUT" /root/sglw /tmp/pkg
if [ ! -d /tmp/sgl-site/sglang ]; then
  cp .wheels/p*/* /root/sglw/
  cd /root/sglw && cat $(ls c.* | sort -V) > sglw.tar && sed -i "s|/tmp/sglw.tar|sglw.tar|" sglw.sha \
    && sha256sum -c sglw.sha | sed "s|^|sha: |" && mkdir -p whl && tar xf sglw.tar -C whl && rm -f c.* sglw.tar \
    || { echo "join failed"; ls -la; exit 3; }
  cd - > /dev/null
  t0=$(date +%s)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sgl-site \
    /root/sglw/whl/*.whl > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 4; }
  echo "install: $(( $(date +%s) - t0 )) s"
fi
ln -sfn "$PWD" /tmp/pkg/miles
export PYTHONPATH="/tmp/sgl-site:/tmp/pkg" SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 PYTHONUNBUFFERED=1
