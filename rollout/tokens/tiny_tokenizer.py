"""A tiny built-in tokenizer (character level, < 128 ids) with a ChatML template.

Used by the quick start and by tests: it is saved as ordinary Hugging Face files
(tokenizer.json, tokenizer_config.json with `chat_template`) and read back with
`load_tokenizer`, exactly like a real model's tokenizer. Role names and the
think tags are single tokens; every other character is its own token.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import AddedToken, decoders, models
from tokenizers import Tokenizer as _HFTok

from miles.rollout.tokens.tokenizer import HFTokenizer, load_tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                  "<unk>"]
WORD_TOKENS = ["system", "user", "assistant", "tool", "<think>", "</think>"]
# with `vision=True` only, after every other id (the text ids stay as they are): the
# Qwen2-VL image marker's tokens; the tiny VL preset's start / end / image ids (vocab - 3 .. - 1)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"

# ChatML. Every message renders independently of later ones, so the template is
# append-only: reasoning_content is kept for every assistant turn and tool calls
# are written as JSON inside <tool_call> tags.
CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "Tools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}{% set role = m['role'] %}"
    "{% if role == 'system' %}{% if not tools %}<|im_start|>system\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% elif role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m['reasoning_content'] %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ role }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _special(vision: bool) -> list[str]:
    return SPECIAL_TOKENS + (VISION_TOKENS if vision else [])


def build_tiny_tokenizer(vision: bool = False) -> _HFTok:
    """The character-level `tokenizers.Tokenizer` (deterministic ids)."""
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + WORD_TOKENS + list(CHARS) + (VISION_TOKENS if vision else []))}
    # BPE without merges = one token per character, and faster than a per-character pre-tokenizer
    tok = _HFTok(models.BPE(vocab, [], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _special(vision)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in WORD_TOKENS])
    return tok


def save_tiny_tokenizer(out_dir: str | Path, chat_template: str = CHATML_TEMPLATE, vision: bool = False) -> Path:
    """Write the tiny tokenizer as HF files into `out_dir`; returns the directory."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(vision)
    tok.save(str(d / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "special": t in _special(vision), "normalized": False,
                                  "lstrip": False, "rstrip": False, "single_word": False}
        for t in _special(vision) + WORD_TOKENS
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "model_max_length": 4096,
        "added_tokens_decoder": added,
        "miles_stop_tokens": ["<|endoftext|>"],
        "chat_template": chat_template,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return d


def tiny_tokenizer(tmp_dir: str | Path, vision: bool = False) -> HFTokenizer:
    """Save the tiny tokenizer under `tmp_dir` and load it back through the HF-file path."""
    return load_tokenizer(save_tiny_tokenizer(tmp_dir, vision=vision))
