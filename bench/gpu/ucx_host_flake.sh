#!/usr/bin/env bash
# Probe: the host-memory ucx sync test (2 engine processes) under UCXX progress settings,
# 3 runs each, on the device:  run(command="bash bench/gpu/ucx_host_flake.sh", carry=[".wheels-min", ".whl-ucx"])
set -u
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT" /tmp/deps /tmp/pkg
pip install -q --no-index --no-deps --target /tmp/deps .wheels-min/*.whl .whl-ucx/*.whl > /dev/null 2>&1
ln -sfn "$PWD" /tmp/pkg/miles
export PYTHONPATH="/tmp/pkg:/tmp/deps" PYTHONUNBUFFERED=1 UCX_WARN_UNUSED_ENV_VARS=n
ip -br addr > "$OUT/ip_addr.txt" 2>&1 || cat /proc/net/dev > "$OUT/ip_addr.txt"
for cfg in ${CONFIGS:-"default" "UCXPY_ENABLE_DELAYED_SUBMISSION=0" "UCXPY_PROGRESS_MODE=blocking" "UCX_TLS=tcp,self"}; do
  for i in 1 2 3; do
    if [ "$cfg" = default ]; then e=(env); else e=(env "$cfg"); fi
    s=$(date +%s)
    "${e[@]}" timeout 60 python -m pytest -q -p no:cacheprovider --import-mode=importlib \
      tests/sync/test_sync_optional.py -k ucx_sync > "/tmp/ucx_$i.txt" 2>&1
    rc=$?
    echo "$cfg run $i: rc=$rc $(( $(date +%s) - s ))s $(grep -o 'sending [0-9]* bytes to engine #[0-9]' /tmp/ucx_$i.txt | head -1)" | tee -a "$OUT/ucx_host_flake.txt"
  done
done
