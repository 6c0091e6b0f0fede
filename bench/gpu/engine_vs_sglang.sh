#!/usr/bin/env bash
# Issues 21 and 38: the torch engine against SGLang 0.5.17 (CUDA graphs on) in the same run on one
# H200: `bench/engine.py --device cuda --sglang` on the dense and MoE models, cases b32, b128,
# b128_t1 (temperature 1), group8x8 and b256 (x 512 new), SGLang driven both ways (B concurrent
# single requests, and one batched /generate), the table reporting each and the ratio to each. The last call of the SGLang recipe (bench/gpu/README.md, "Torch engine vs SGLang in one
# run"): calls 1-8 carry .wheels/p0..p7, this one carries p8 (the last chunk and the sha), joins,
# installs, runs:
#   run(command="MILES_COMMIT=<sha> bash bench/gpu/engine_vs_sglang.sh", carry=[".wheels/p8"], timeout_s=600)
# ENGINE_ARGS: more bench/engine.py arguments (later ones win, e.g. --hf dense:b32); LIMIT_S: the
# bench's time limit (s). Output in $OUT: engine_vs_sglang.txt (table + JSON line),
# engine_vs_sglang.json (written after every case, so a cut run keeps its finished cases),
# sglang_server_{dense,moe}.log (tails of the servers' logs).
set -u
OUT="${OUT:-/tmp/out}"
SGL_DIR=/tmp/miles-bench-sglang
# shellcheck source=bench/gpu/sglang_install.sh
source bench/gpu/sglang_install.sh
{ echo "# issues 21/38, H200, commit ${MILES_COMMIT:-unknown}, $(date -u '+%Y-%m-%d %H:%M UTC'), bench/gpu/engine_vs_sglang.sh"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/# /'
  python3 -c "from importlib.metadata import version as v; print('# sglang', v('sglang'), 'torch', v('torch'), \
    'transformers', v('transformers'))" 2>&1 | tail -1
} > "$OUT/engine_vs_sglang.txt"
cat "$OUT/engine_vs_sglang.txt"
# The bench stops its servers on SIGTERM (timeout's first signal); -k only if that hangs.
timeout -k 40 "${LIMIT_S:-520}" python3 bench/engine.py --device cuda --sglang --models dense,moe \
  --cases b32,b128,b128_t1,group8x8,b256 --sglang-modes requests,batched --hf "" --repeats 5 --budget-s 25 --sglang-dir "$SGL_DIR" \
  --out "$OUT/engine_vs_sglang.json" \
  ${ENGINE_ARGS:-} 2>&1 | grep --line-buffered -v 'Loading weights\|Capturing batches' | tee -a "$OUT/engine_vs_sglang.txt"
# A server outlives a killed bench (its own session): end it by the pid the bench recorded.
for f in "$SGL_DIR"/*/server.pid; do
  [ -f "$f" ] && kill -9 -- "-$(cat "$f")" 2>/dev/null && echo "ended a leftover server ($f)"
done
for k in dense moe; do
  [ -f "$SGL_DIR/$k/server.log" ] && tail -c 4000000 "$SGL_DIR/$k/server.log" > "$OUT/sglang_server_$k.log"
done
exit 0
