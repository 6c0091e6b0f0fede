"""Tokenizers built in code for the rollout tests (saved and loaded as HF files)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTok

from miles.rollout.tokens.tokenizer import HFTokenizer, load_tokenizer

# The seed's worked example: "Hello" -> [101, 102], "world!" -> [103, 104].
SEED_PIECES = {"Hel": 101, "lo": 102, "world": 103, "!": 104, " ": 105, "Bye": 106}
CONTENT_ONLY_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"

# ChatML that drops reasoning of assistant turns before the last user message (as some
# released templates do): rendering turn by turn is then not a prefix of the whole.
DROPS_REASONING_TEMPLATE = (
    "{% set ns = namespace(last_user=0) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content and loop.index0 > ns.last_user %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def seed_tokenizer(tmp: Path) -> HFTokenizer:
    vocab = {f"<f{i}>": i for i in range(101)}
    vocab.update(SEED_PIECES)
    vocab["<eot>"] = 107
    tok = _HFTok(models.WordLevel(vocab, unk_token="<f0>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"Hel|lo|world|Bye|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken("<eot>", special=True, normalized=False)])
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eot>", "chat_template": CONTENT_ONLY_TEMPLATE}))
    return load_tokenizer(tmp)
