#!/usr/bin/env bash
# Weight-sync and perftest measurements on one H200, in one device call:
#   run(command="bash bench/h200_sync_suite.sh", carry=[".wheels-min", ".whl-ucx"])
# .wheels-min: cp312 pyzmq, structlog, pytest-asyncio (the rest is on the image);
# .whl-ucx: the six UCXX cu13 wheels of bench/gpu/README.md. Everything lands in one tarball.
set -u
OUT="${OUT:-/tmp/out}"
R=/tmp/res
mkdir -p "$OUT" "$R" /tmp/deps /tmp/pkg
pip install -q --no-index --no-deps --target /tmp/deps .wheels-min/*.whl .whl-ucx/*.whl > "$R/install.log" 2>&1
ln -sfn "$PWD" /tmp/pkg/miles
export PYTHONPATH="/tmp/pkg:/tmp/deps:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export UCX_WARN_UNUSED_ENV_VARS=n UCX_TLS=cuda_copy,cuda_ipc,sm,tcp,self
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/gpu.txt" 2>&1
git rev-parse HEAD > "$R/commit.txt" 2>/dev/null || true
date -u +%FT%TZ > "$R/date.txt"
STEP_DIR="$R"
# shellcheck source=bench/suite_step.sh
source bench/suite_step.sh
SIZES=8B,512B,4KiB,64KiB,1MiB,4MiB,32MiB,128MiB,512MiB
step gpu_tests 150 python -m pytest -q -p no:cacheprovider --import-mode=importlib -rs \
  tests/sync/test_sync_optional.py tests/engines/test_engines_swap_graphs.py
# The host-memory ucx test again with UCX's own transport choice (the export above pins UCX_TLS).
step ucx_host_default_tls 60 env -u UCX_TLS python -m pytest -q -p no:cacheprovider --import-mode=importlib \
  tests/sync/test_sync_optional.py -k ucx_sync
step weight_sync_gpu 300 python bench/weight_sync_gpu.py
step flat_sync_trace 120 python bench/gpu/flat_sync_trace.py --gb 8 --bucket-mib 512
step ipc_copy_probe 60 python bench/gpu/ipc_copy_probe.py --gb 8 --bucket-mib 512
if [ -n "${SKIP_PERFTEST:-}" ]; then  # SKIP_PERFTEST=1: tests and weight sync only
  tar czf "$OUT/sync_h200.tgz" -C "$R" .; cp "$R"/{weight_sync_gpu,flat_sync_trace,gpu_tests}.txt "$OUT/" 2>/dev/null; exit 0
fi
pt() {  # pt NAME ARGS...
  local name=$1; shift
  step "perftest_$name" 100 python -m miles.launch.cli perftest "$@" --sizes $SIZES --max-bytes 2GiB \
    --json "$R/perftest_h200_$name.json" --csv "$R/perftest_h200_$name.csv"
}
pt cuda_ipc --transport cuda-ipc --pattern stream
pt ucx_cuda --transport ucx --device cuda --pattern stream
pt ucx_pinned --transport ucx --device pinned --pattern stream
pt zmq_bulk_pinned --transport zmq-bulk --device pinned --pattern stream
python -m miles.perftest.plot "$R/perftest_h200.png" "$R"/perftest_h200_*.json > "$R/plot.txt" 2>&1
tar czf "$OUT/sync_h200.tgz" -C "$R" .
cp "$R/weight_sync_gpu.txt" "$OUT/" 2>/dev/null
exit 0
