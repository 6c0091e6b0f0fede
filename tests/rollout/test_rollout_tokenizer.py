"""The tokenizers+Jinja tokenizer and the tiny built-in one, saved and loaded as HF files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.core.errors import ConfigError
from miles.rollout.tokens.tiny_tokenizer import save_tiny_tokenizer, tiny_tokenizer
from miles.rollout.tokens.tokenizer import Tokenizer, load_tokenizer

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12+30?"},
    {"role": "assistant", "content": "", "reasoning_content": "add",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "calc", "arguments": {"expr": "12+30"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "42"},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "Thanks, é!"},
]
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


def test_tiny_tokenizer_round_trip(tmp_path: Path) -> None:
    tok = tiny_tokenizer(tmp_path)
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size < 512
    assert tok.eos_token_id == tok.token_to_id("<|im_end|>")
    assert tok.stop_token_ids == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    text = tok.apply_chat_template(CONV[:2], add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids.count(tok.token_to_id("<|im_start|>")) == 3
    assert tok.encode("12") == [tok.token_to_id("1"), tok.token_to_id("2")]
    # unknown characters map to <unk> instead of failing
    assert tok.token_to_id("<unk>") in tok.encode("é")


def test_template_renders_tools_and_reasoning(tmp_path: Path) -> None:
    tok = tiny_tokenizer(tmp_path)
    text = tok.apply_chat_template(CONV, tools=TOOLS)
    assert "<think>add</think>" in text
    assert '<tool_call>{"name": "calc", "arguments": {"expr": "12+30"}}</tool_call>' in text
    assert "<|im_start|>tool\n42<|im_end|>" in text
    assert text.startswith("<|im_start|>system\nBe brief.\n\nTools:\n")


def test_same_render_as_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    d = save_tiny_tokenizer(tmp_path)
    ours = load_tokenizer(d)
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    for conv, tools in ((CONV, TOOLS), (CONV[:2], None)):
        a = ours.apply_chat_template(conv, tools=tools, add_generation_prompt=True)
        b = theirs.apply_chat_template(conv, tools=tools, add_generation_prompt=True, tokenize=False)
        assert a == b
        assert ours.encode(a) == theirs.encode(a, add_special_tokens=False)


def test_load_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    d = save_tiny_tokenizer(tmp_path / "t")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="no chat template"):
        load_tokenizer(d)
    cfg["chat_template"] = "{% for m in messages %}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="does not compile"):
        load_tokenizer(d)
    cfg["chat_template"] = "x"
    cfg["eos_token"] = "<nope>"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="eos_token '<nope>'"):
        load_tokenizer(d)
