#!/usr/bin/env bash
# The 2-GPU suite (nvidia-h200-x2), in one device call:
#   run(kind="nvidia-h200-x2", command="bash bench/multi_gpu/run_all.sh", carry=[".wheels-lead"])
# Installs the carried cp312 wheels, makes the checkout importable as `miles`, keeps NCCL's
# NVLink multicast off, then runs each part under its own time limit. JSON results and one
# log land in $OUT (5 files). `DEVICE=cpu bash bench/multi_gpu/run_all.sh` is the gloo smoke run.
set -u
OUT="${OUT:-/tmp/mg_out}"
DEVICE="${DEVICE:-cuda}"
WORK=/tmp/mg_work
mkdir -p "$OUT" "$WORK" /tmp/deps /tmp/pkg
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=python3
if [ "$DEVICE" = cuda ]; then
  pip install -q --no-index --no-deps --target /tmp/deps .wheels-lead/*.whl > "$WORK/install.log" 2>&1
  ln -sfn "$PWD" /tmp/pkg/miles
  export PYTHONPATH="/tmp/pkg:/tmp/deps:${PYTHONPATH:-}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
  nvidia-smi topo -m >> "$OUT/gpu.txt" 2>&1
  WS_ARGS="--sizes-gb 0.5 2 8 --buckets-mib 128 512 1024 --timeout 70"
  FS_ARGS="--timeout 55"
  DA_STEPS=10
else
  PY="${PY_CPU:-/work/venv/bin/python}"
  WS_ARGS=""
  FS_ARGS=""
  DA_STEPS=3
fi
PARTS="${PARTS:-weight_sync fsdp disagg}"  # e.g. PARTS="disagg tests" to re-run only those
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  case " $PARTS " in *" $name "*) ;; *) return 0 ;; esac
  echo "== $name ($(date +%T))" | tee -a "$OUT/run_all.log"
  timeout "$secs" "$@" >> "$OUT/run_all.log" 2>&1
  local rc=$?
  echo "rc=$rc ($name)" | tee -a "$OUT/run_all.log"
  if [ -f "$WORK/$name.json" ]; then cp "$WORK/$name.json" "$OUT/multigpu_$name.json"; fi
}
# shellcheck disable=SC2086
step weight_sync 80 $PY bench/multi_gpu/weight_sync_nccl.py --device "$DEVICE" $WS_ARGS --out "$WORK/weight_sync.json"
# shellcheck disable=SC2086
step fsdp 120 $PY bench/multi_gpu/fsdp_2gpu.py --device "$DEVICE" $FS_ARGS --out "$WORK/fsdp.json"
step disagg 80 $PY bench/multi_gpu/disagg_async.py --device "$DEVICE" --steps "$DA_STEPS" --out "$WORK/disagg.json"
step tests 120 $PY -m pytest -q -p no:cacheprovider --import-mode=importlib tests/multigpu tests/sync/test_sync_optional.py
exit 0
