"""The append-only verifier: flags a reasoning-dropping template, passes ChatML."""

from __future__ import annotations

import json
from pathlib import Path

from miles.rollout.tokens.template_check import CANONICAL, FALLBACKS, check_template
from miles.rollout.tokens.tiny_tokenizer import save_tiny_tokenizer, tiny_tokenizer
from miles.rollout.tokens.tokenizer import load_tokenizer

from .tok_fixtures import DROPS_REASONING_TEMPLATE, seed_tokenizer


def test_append_only_template_passes(tmp_path: Path) -> None:
    rep = check_template(tiny_tokenizer(tmp_path))
    assert rep.ok, rep.summary()
    assert set(rep.checked) == set(CANONICAL)
    assert {"multi_turn", "system_prompt", "tool_calls", "reasoning"} <= set(CANONICAL)


def test_template_dropping_earlier_reasoning_is_flagged(tmp_path: Path) -> None:
    d = save_tiny_tokenizer(tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = DROPS_REASONING_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    rep = check_template(load_tokenizer(d))
    assert not rep.ok
    bad = {(f.conversation, f.turn, f.kind) for f in rep.findings}
    # the first assistant turn's reasoning is rendered while it is last, dropped later
    assert ("reasoning", 1, "history_not_prefix") in bad
    assert all(f.conversation == "reasoning" for f in rep.findings)
    f = next(f for f in rep.findings if f.turn == 1)
    assert f.got.startswith("<think>") and not f.expected.startswith("<think>")
    assert "reasoning @ assistant message 1" in rep.summary()
    assert "anchor_diff" in FALLBACKS


def test_token_merges_across_turns_are_flagged(tmp_path: Path) -> None:
    tok = seed_tokenizer(tmp_path)
    conv = {"merge": ([{"role": "user", "content": "wor"}, {"role": "assistant", "content": "ld"},
                       {"role": "user", "content": "!"}], None)}
    rep = check_template(tok, conv)
    assert [f.kind for f in rep.findings] == ["token_boundary"]
    assert rep.findings[0].position == 0
