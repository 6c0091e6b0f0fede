#!/usr/bin/env bash
# Real learning on Qwen2.5-Coder-0.5B-Instruct (issue 44) and SGLang on it (issue 45), one GPU.
# Every call carries one chunk folder (64 MiB cap per call, the machine warm between back-to-back calls):
#   run(command="bash bench/gpu/qwen_suite.sh take", carry=[".carry/cNN"])     NN = 00..19
# c00-c09: learn.tar (cp312 wheels, GSM8K gz, the 491 MB GGUF); c10-c19: sglw.tar (SGLang 0.5.17's 56
# wheels); carry.sha in c00 and c10; all built here by `bash bench/gpu/payload.sh` (25 s, no device time).
# `take` joins and unpacks each tar once all its chunks are here:
#   /root/pl/{whl,data,qwen.gguf} -> /tmp/site (wheels), /root/gsm8k, /root/qwen-hf (converted in `learn`)
# Then detached stages (they survive their call while the machine stays warm) and their collection:
#   bash bench/gpu/qwen_suite.sh bg learn     # 3 GSM8K runs at once (torch engine: sync s0, fully_async s0/s1)
#   bash bench/gpu/qwen_suite.sh bg sgl       # the same recipe with engine.type=sglang, beside them
#   bash bench/gpu/qwen_suite.sh mem | trl    # foreground, the GPU to itself: trainer memory; TRL
#   bash bench/gpu/qwen_suite.sh bg sgl16     # s16's SGLang run alone; bg solo: one torch run alone (MODE, SEED)
#   bash bench/gpu/qwen_suite.sh collect learn 560
# Results in $OUT: runs_<stage>.tgz (each run's metrics.jsonl, eval jsonl, console tail, errors), memory.json,
# trl.txt, stage.log. Summaries are made on the CPU side from the run dirs (bench/learn_summary.py).
set -u
STAGE="${1:-take}"
OUT="${OUT:-/tmp/out}"
LIMIT="${LIMIT:-600}"          # run.time_limit_s of each GSM8K run
# A detached stage imports miles from its own snapshot through its own link (PKG), so the next call's
# fresh copy of the tree never changes the code under a running stage.
PKG="${PKG:-/tmp/pkg}"
mkdir -p "$OUT" "$PKG" /tmp/learn
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ln -sfn "$PWD" "$PKG/miles"
export PYTHONPATH="$PKG:/tmp/site:${PYTHONPATH:-}"
COMMIT="${MILES_COMMIT:-$(cat .commit 2>/dev/null || echo unknown)}"
D=/root/gsm8k
M=/root/qwen-hf

take() {
  mkdir -p /root/carry && cp .carry/c*/* /root/carry/ 2>/dev/null
  cd /root/carry || return 3
  echo "carry: $(ls | tr '\n' ' ')"
  if [ -f L.09 ] && [ ! -f /root/pl/.done ]; then
    cat $(ls L.* | sort -V) > learn.tar && grep learn.tar carry.sha | sha256sum -c - || return 3
    mkdir -p /root/pl "$D" && tar xf learn.tar -C /root/pl && rm -f L.* learn.tar || return 3
    gunzip -c /root/pl/data/train.jsonl.gz > "$D/train.jsonl" && gunzip -c /root/pl/data/test.jsonl.gz > "$D/test.jsonl"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      /root/pl/whl/*.whl > /root/pl/install.log 2>&1 || { tail -5 /root/pl/install.log; return 4; }
    touch /root/pl/.done && echo "learn payload: $(ls /root/pl/whl | wc -l) wheels, $(wc -l < "$D/train.jsonl") train rows"
  fi
  if [ -f S.09 ] && [ ! -d /tmp/sgl-site/sglang ]; then
    cat $(ls S.* | sort -V) > sglw.tar && grep sglw.tar carry.sha | sha256sum -c - || return 3
    mkdir -p /root/sglw/whl && tar xf sglw.tar -C /root/sglw/whl && rm -f S.* sglw.tar || return 3
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sgl-site \
      /root/sglw/whl/*.whl > /root/sglw/install.log 2>&1 || { tail -5 /root/sglw/install.log; return 4; }
    touch /tmp/sgl-site/.done && echo "sglang payload: $(ls /root/sglw/whl | wc -l) wheels installed"
  fi
}

convert() {  # the GGUF -> HF directory once, through `miles fetch-model --from` (sha256, join, convert, template)
  [ -f "$M/config.json" ] && return 0
  t0=$(date +%s)
  mkdir -p /root/pl/gg && ln -sf /root/pl/qwen.gguf /root/pl/gg/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
  python3 -m miles.launch.cli fetch-model qwen2.5-coder-0.5b --out "$M" --from /root/pl/gg > "$OUT/convert.log" 2>&1 \
    || { tail -20 "$OUT/convert.log"; return 1; }
  echo "converted in $(( $(date +%s) - t0 )) s: $(ls "$M" | tr '\n' ' ')" | tee -a "$OUT/log.txt"
}

# The recipe: examples/gsm8k.toml on all of GSM8K with the real checkpoint, 512 new tokens, the held-out
# eval on all 1,319 test rows at start and end; a run sharing the card sets a longer heartbeat timeout.
RECIPE="${RECIPE:-examples/gsm8k_qwen.toml}"
# Shaped reward: 1.2 for the right number after ####, 0.2 for a right last number without it. At step 0 the
# model never writes #### greedily, so the strict reward alone may give no group any signal.
SHAPED='[{type="math", extract="hash"}, {type="math", extract="auto", weight=0.2}]'
SHAPED_JSON='[{"type": "math", "extract": "hash"}, {"type": "math", "extract": "auto", "weight": 0.2}]'
G=(--set "model.path=$M" --set "rollout.env_args.path=$D/train.jsonl" --set "rollout.env_args.eval_path=$D/test.jsonl"
   --set "run.time_limit_s=$LIMIT" --set transport.heartbeat_timeout_s=20 ${EXTRA_SETS:-})

train() {  # NAME TIMEOUT --set ...
  local name="$1" to="$2"; shift 2
  rm -rf "/tmp/learn/$name"
  MILES_CACHE="/tmp/cache-$name" timeout "$to" python3 -m miles.launch.cli train "$RECIPE" \
    --set "run.dir=/tmp/learn/$name" --set run.progress=false "${G[@]}" "$@" > "/tmp/learn/$name.console" 2>&1
  echo "$name exit $? at $(date +%T)" >> "$OUT/log.txt"
}

pack() {
  for d in /tmp/learn/*/; do
    [ -d "$d" ] || continue
    n=$(basename "$d")
    python3 -m miles.launch.cli report "$d" > /dev/null 2>&1
    tail -60 "/tmp/learn/$n.console" > "$d/console_tail.txt" 2>/dev/null
    grep -h '"level": "error"\|nonfinite' "$d"/logs/*.log 2>/dev/null | tail -40 > "$d/errors.txt"
  done
  (cd /tmp/learn && tar czf "$OUT/runs_$1.tgz" --exclude=final_hf --exclude=tb --exclude='*.safetensors' \
    --exclude=checkpoints --exclude=eval . 2>/dev/null)
}

case "$STAGE" in
take) take; exit $? ;;
bg)  # bg STAGE: STAGE detached, from a snapshot of this tree (the next call's copy replaces this one)
  S="$2"; rm -rf "/root/snap-$S" "/root/out-$S"; mkdir -p "/root/out-$S"
  tar cf - --exclude=./.carry . | (mkdir -p "/root/snap-$S" && cd "/root/snap-$S" && tar xf -)
  (cd "/root/snap-$S" && PKG="/tmp/pkg-$S" OUT="/root/out-$S" MILES_COMMIT="$COMMIT" LIMIT="$LIMIT" EXTRA_SETS="${EXTRA_SETS:-}" SYNC1="${SYNC1:-0}" TRL="${TRL:-1}" TSEED="${TSEED:-0}" SSEED="${SSEED:-0}" SGL="${SGL:-1}" PROBE="${PROBE:-1}" \
    setsid nohup bash -c "bash bench/gpu/qwen_suite.sh $S; touch /root/out-$S/done" > "/root/out-$S/stage.log" 2>&1 < /dev/null &)
  sleep 3; echo "started $S: $(pgrep -fc "qwen_suite.sh $S") processes"; exit 0 ;;
collect)  # collect STAGE WAIT_S: wait for a bg STAGE (at most WAIT_S), then copy its results to $OUT
  S="$2"; W="${3:-0}"; t0=$(date +%s)
  while [ ! -f "/root/out-$S/done" ] && [ $(( $(date +%s) - t0 )) -lt "$W" ]; do sleep 5; done
  [ -f "/root/out-$S/done" ] && echo "$S done" || { echo "$S still running after ${W}s"; pack partial; }
  cat "/root/out-$S/log.txt" 2>/dev/null
  bash "$0" status
  cp -r "/root/out-$S"/. "$OUT/" 2>/dev/null; exit 0 ;;
learn)  # three torch-engine runs at once (~16 GB each: trainer ~11 GB at 16k packs + engine)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt"
  convert || exit 1
  train sync_s0 $((LIMIT + 500)) --set buffer.mode=sync --set run.seed=0 --set rollout.env_args.seed=0 &
  train async_s0 $((LIMIT + 500)) --set run.seed=0 --set rollout.env_args.seed=0 &
  train async_s1 $((LIMIT + 500)) --set run.seed=1 --set rollout.env_args.seed=1 &
  if [ "${SYNC1:-0}" = 1 ]; then  # a card with room for a fourth (H200)
    train sync_s1 $((LIMIT + 500)) --set buffer.mode=sync --set run.seed=1 --set rollout.env_args.seed=1 &
  fi
  wait; pack learn ;;
sgl)  # SGLang as the engine of the same recipe, beside the learn stage's runs (server capped at 15 %)
  export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
  SG=(--set engine.type=sglang --set 'engine.sglang_extra_args=["--attention-backend","triton","--sampling-backend","pytorch","--grammar-backend","none","--skip-server-warmup"]'
      --set engine.sglang_startup_timeout_s=400 --set "engine.sglang_mem_fraction=${SGL_MEM:-0.12}")
  PYTHONPATH="/tmp/sgl-site:$PYTHONPATH" train strict_sgl_async_s0 $((LIMIT + 600)) "${SG[@]}" --set run.seed=0 \
    --set rollout.env_args.seed=0 --set "rollout.env_args.rewards=${REWARDS:-$SHAPED}"
  pack sgl ;;
strict)  # the reward asks for the prompt's format (math, extract = "hash": only the number after ####):
  # torch engine sync and fully_async, SGLang fully_async, and TRL's GRPOTrainer with the same reward, batch,
  # sampling and lr, all at once (the card and its 16 cores shared). An 80 GB card takes three miles runs.
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt"
  convert || exit 1
  big=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{print ($1 > 100000)}')
  export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
  R=(--set "rollout.env_args.rewards=${REWARDS:-$SHAPED}")
  SG=(--set engine.type=sglang --set 'engine.sglang_extra_args=["--attention-backend","triton","--sampling-backend","pytorch","--grammar-backend","none","--skip-server-warmup"]'
      --set engine.sglang_startup_timeout_s=400 --set "engine.sglang_mem_fraction=$([ "$big" = 1 ] && echo 0.15 || echo 0.12)")
  train strict_sync_s0 $((LIMIT + 500)) "${R[@]}" --set buffer.mode=sync --set run.seed=0 --set rollout.env_args.seed=0 &
  train strict_async_s0 $((LIMIT + 500)) "${R[@]}" --set run.seed=0 --set rollout.env_args.seed=0 &
  if [ -d /tmp/sgl-site/sglang ]; then
    PYTHONPATH="/tmp/sgl-site:$PYTHONPATH" train strict_sgl_async_s0 $((LIMIT + 600)) "${R[@]}" "${SG[@]}" \
      --set run.seed=0 --set rollout.env_args.seed=0 &
  fi
  if [ "$big" = 1 ] || { [ "${SGL_LATER:-0}" = 0 ] && [ ! -d /tmp/sgl-site/sglang ]; }; then
    train strict_async_s1 $((LIMIT + 500)) "${R[@]}" --set run.seed=1 --set rollout.env_args.seed=1 &
  fi
  if [ "$big" = 1 ] && [ "${TRL:-1}" = 1 ]; then
    timeout $((LIMIT + 400)) python3 bench/learn_trl.py --model "$M" --data "$D" --max-calc-steps 0 \
      --max-new-tokens 512 --lr 2e-6 --eval-prompts 1319 --eval-batch 660 --micro-batch 16 --reward-extract hash --rewards "$SHAPED_JSON" \
      --time-limit "$LIMIT" > /tmp/learn/trl.txt 2>&1; echo "trl exit $? at $(date +%T)" >> "$OUT/log.txt"
    cp /tmp/learn/trl.txt "$OUT/trl.txt"
  fi
  wait; pack strict ;;
s16)  # the recipe as shipped: SGLang's run first (SGLang 0.5.17 refuses a --mem-fraction-static below the
  # share others hold when it starts), then the torch-engine runs once its server holds its memory. PACK:
  # trainer.micro_batch_tokens (session 16 ran 8k: the trainer's peak was 15.0 GB, as at 16k).
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt"
  convert || exit 1
  big=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{print ($1 > 100000)}')
  P=(--set "trainer.micro_batch_tokens=${PACK:-16384}")
  case "${FORMAT:-recipe}" in  # the answer format the prompt asks for, its reward and strict scorer
    boxed) P+=(--set rollout.env_args.answer_format=boxed
               --set $'rollout.env_args.prompt_template={prompt}\nPlease reason step by step, and put your final answer within \\boxed{}.'
               --set 'rollout.env_args.rewards=[{type="math", extract="boxed"}, {type="math", extract="auto", weight=0.2}]') ;;
    hash_line) P+=(--set 'rollout.env_args.prompt_template={prompt}
Think step by step. End your answer with a last line of the form: #### <number>') ;;
    hash_sys) P+=(--set 'rollout.env_args.prompt_template={prompt}'
                  --set 'rollout.env_args.system_prompt=Solve the problem step by step. On the last line write the final answer as: #### <number>') ;;
  esac
  echo "format ${FORMAT:-recipe}: ${P[*]}" >> "$OUT/log.txt"
  if [ "${PROBE:-1}" = 1 ]; then  # the answer formats under each prompt, on the side (~3 GB of the card)
    timeout 400 python3 bench/prompt_format_probe.py --model "$M" --data "$D/test.jsonl" --device cuda --questions 32 \
      --samples 4 --max-new-tokens 512 --variants "${VARIANTS:-hash,hash_sys,hash_line,boxed}" \
      --out "$OUT/probe.json" > "$OUT/probe.txt" 2>&1 &
  fi
  t0=$(date +%s)  # SGLang's wheels may still be on their way (carried while the model converts)
  until [ -f /tmp/sgl-site/.done ] || [ "${SGL:-1}" = 0 ] || [ $(( $(date +%s) - t0 )) -ge "${SGL_WAIT:-150}" ]; do sleep 3; done
  if [ -f /tmp/sgl-site/.done ] && [ "${SGL:-1}" = 1 ]; then
    export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
    SG=(--set engine.type=sglang --set 'engine.sglang_extra_args=["--attention-backend","triton","--sampling-backend","pytorch","--grammar-backend","none","--skip-server-warmup"]'
        --set engine.sglang_startup_timeout_s=400 --set "engine.sglang_mem_fraction=${SGL_MEM:-0.1}")
    PYTHONPATH="/tmp/sgl-site:$PYTHONPATH" train "sgl_async_s${SSEED:-0}" $((LIMIT + 700)) "${P[@]}" "${SG[@]}" \
      --set "run.seed=${SSEED:-0}" --set "rollout.env_args.seed=${SSEED:-0}" &
    # The torch runs start once SGLang's processes hold ~its share of the card (its memory check is behind
    # it then; the CUDA graphs it captures next need little), once it answers, or after 200 s.
    tot=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    want=$(awk -v t="$tot" -v f="${SGL_MEM:-0.1}" 'BEGIN{print int(t * f * 0.8)}')
    t0=$(date +%s)
    while :; do
      held=$(python3 - <<'EOF3'
import subprocess
def root_is_server(pid: int) -> bool:  # the process or an ancestor is `python -m sglang.launch_server`
    for _ in range(8):
        try:
            if b"sglang.launch_server" in open(f"/proc/{pid}/cmdline", "rb").read():
                return True
            pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False
out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                     capture_output=True, text=True).stdout
print(sum(int(m) for p, m in (r.replace(" ", "").split(",") for r in out.splitlines() if "," in r)
          if root_is_server(int(p))))
EOF3
)
      if [ "$held" -ge "$want" ] || grep -qs sglang_engine_ready "/tmp/learn/sgl_async_s${SSEED:-0}"/logs/*.log \
         || [ $(( $(date +%s) - t0 )) -ge 200 ]; then break; fi
      sleep 2
    done
    echo "sglang holds ${held} MiB (want ${want}) after $(( $(date +%s) - t0 )) s at $(date +%T)" >> "$OUT/log.txt"
  fi
  if [ "${TORCH:-1}" = 0 ]; then wait; pack s16; exit 0; fi  # SGLang's run alone, the card to itself
  T=${TSEED:-0}  # the torch runs' seed (session 19: 1, beside session 18's seed 0)
  train "async_s$T" $((LIMIT + 500)) "${P[@]}" --set "run.seed=$T" --set "rollout.env_args.seed=$T" &
  train "sync_s$T" $((LIMIT + 500)) "${P[@]}" --set buffer.mode=sync --set "run.seed=$T" --set "rollout.env_args.seed=$T" &
  if [ "$big" = 1 ] && [ "$T" = 0 ]; then  # an H200: a second seed beside them (~26 GB a torch run: trainer 15 + engine)
    train async_s1 $((LIMIT + 500)) "${P[@]}" --set run.seed=1 --set rollout.env_args.seed=1 &
    if [ "${SYNC1:-0}" = 1 ]; then  # a fifth run leaves < 10 GB of an H200 free beside SGLang: asked for only
      train sync_s1 $((LIMIT + 500)) "${P[@]}" --set buffer.mode=sync --set run.seed=1 --set rollout.env_args.seed=1 &
    fi
  fi
  wait; pack s16 ;;
sgl16)  # s16's SGLang run alone (TORCH=0), its own stage dir so an earlier s16's results stay
  TORCH=0 exec bash "$0" s16 ;;
solo)  # one torch-engine run with the card to itself (MODE=fully_async|sync, SEED): the 15-minute goal on
  # one GPU, where s16's runs share the card (session 18: fully_async's step 4.1 s beside a sync run)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt"
  convert || exit 1
  M_=(); [ "${MODE:-fully_async}" = sync ] && M_=(--set buffer.mode=sync)
  train "solo_${MODE:-fully_async}_s${SEED:-0}" $((LIMIT + 500)) --set "trainer.micro_batch_tokens=${PACK:-16384}" \
    "${M_[@]}" --set "run.seed=${SEED:-0}" --set "rollout.env_args.seed=${SEED:-0}"
  pack solo ;;
probe)  # which answer format the checkpoint writes under each prompt (seconds on a GPU)
  convert || exit 1
  timeout 300 python3 bench/prompt_format_probe.py --model "$M" --data "$D/test.jsonl" --device cuda --questions 64 \
    --samples 8 --max-new-tokens 512 --variants "${VARIANTS:-hash,hash_sys,hash_line,boxed,boxed_sys}" \
    --out "$OUT/probe.json" > "$OUT/probe.txt" 2>&1; tail -14 "$OUT/probe.txt" ;;
fmt)  # the same recipe with a prompt that shows the answer format once (the model never writes #### unprompted)
  T=$'{prompt}\nThink step by step. Then write the final answer on its own last line in the form "#### <number>", for example:\n#### 42'
  train "strict_fmt_${MODE:-async}_s0" $((LIMIT + 500)) --set "rollout.env_args.rewards=${REWARDS:-$SHAPED}" \
    --set "rollout.env_args.prompt_template=$T" --set run.seed=0 --set rollout.env_args.seed=0 \
    $([ "${MODE:-async}" = sync ] && echo --set buffer.mode=sync)
  pack fmt ;;
snap)  # what the runs have so far, to $OUT (a hedge against losing the machine mid-run)
  pack partial; cp /root/out-*/log.txt "$OUT/" 2>/dev/null; cp /tmp/learn/trl.txt "$OUT/" 2>/dev/null; exit 0 ;;
status)  # one line per run: step, reward, peak GB, skipped, last eval
  cd /tmp/learn 2>/dev/null || exit 0
  for d in */; do python3 - "$d" <<'EOF2'
import glob, json, sys
d = sys.argv[1]
try:
    rows = [json.loads(x) for x in open(d + "metrics.jsonl")]
except OSError:
    rows = []
if not rows:
    print(d, "no step yet"); sys.exit()
r = rows[-1]
ks = ["step", "rollout/reward_mean", "train/train_rollout_logprob_abs_diff", "perf/trainer_peak_gb",
      "train/skipped_nonfinite_total", "perf/step_time_s"]
print(d, {k.split("/")[-1]: round(r[k], 4) if isinstance(r.get(k), float) else r.get(k) for k in ks})
for e in ([json.loads(x) for x in open(d + "eval.jsonl")] if glob.glob(d + "eval.jsonl") else [])[-2:]:
    print("  eval", e.get("step"), {k.split("/", 1)[-1]: round(v, 3) for k, v in e.items()
                                    if "accuracy" in k and isinstance(v, float)})
EOF2
  done
  nvidia-smi --query-gpu=memory.used --format=csv,noheader; tail -2 /tmp/learn/trl.txt 2>/dev/null | cut -c1-300 ;;
wheels)  # only miles' cp312 wheels (the first members of chunk c00), for runs that need no model carries
  mkdir -p /root/pl && tar xf .carry/c00/L.00 -C /root/pl whl 2>/dev/null; echo "wheels: $(ls /root/pl/whl | wc -l)"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /root/pl/whl/*.whl > /tmp/install.log 2>&1 || tail -3 /tmp/install.log ;;
sgle2e)  # bench/gpu/sglang_e2e.py's cases (CASES, STEPS, LIMIT_S) once `wheels` and the SGLang chunks are in
  MILES_COMMIT="$COMMIT" bash bench/gpu/sglang_e2e.sh ;;
memfast)  # trainer peak memory of the 0.5B shape with random weights (memory depends on the shape only), in
  # one call: the cp312 wheels are the first members of chunk c00, so no other chunk is needed
  mkdir -p /root/pl && tar xf .carry/c00/L.00 -C /root/pl whl 2>/dev/null; echo "wheels: $(ls /root/pl/whl | wc -l)"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /root/pl/whl/*.whl > /tmp/install.log 2>&1 || tail -3 /tmp/install.log
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  timeout "${MEM_S:-400}" python3 bench/trainer_memory.py --cases "${MEM_CASES:-bf16_16k_before,bf16_16k,fp32_8k_before,fp32_8k}" \
    --out "$OUT/memory.json" 2>&1 | tee "$OUT/memory.txt" ;;
mem)  # trainer peak memory per case, the GPU to itself
  timeout 300 python3 bench/trainer_memory.py --model "$M" --cases bf16_16k_before,bf16_16k,fp32_8k_before,fp32_8k \
    --out "$OUT/memory.json" > "$OUT/memory.txt" 2>&1; cat "$OUT/memory.txt" ;;
trl)  # TRL's GRPOTrainer on the same checkpoint, data, batch and sampling, the GPU to itself
  timeout $((LIMIT + 500)) python3 bench/learn_trl.py --model "$M" --data "$D" --max-calc-steps 0 \
    --max-new-tokens 512 --lr "${TRL_LR:-2e-6}" --eval-prompts 1319 --eval-batch 330 --micro-batch 16 \
    --time-limit "$LIMIT" > "$OUT/trl.txt" 2>&1; echo "trl exit $?" >> "$OUT/log.txt"; tail -3 "$OUT/trl.txt" ;;
*) echo "unknown stage $STAGE"; exit 2 ;;
esac
exit 0
