"""The TITO session store: the seed's worked example, linear vs branching, tools, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from miles.core.errors import Diverged, NotAppendOnly, SessionError
from miles.rollout.tito.store import SessionStore
from miles.rollout.tokens.tiny_tokenizer import save_tiny_tokenizer, tiny_tokenizer
from miles.rollout.tokens.tokenizer import HFTokenizer, load_tokenizer

from .tok_fixtures import DROPS_REASONING_TEMPLATE, seed_tokenizer


class RecordingTokenizer(HFTokenizer):
    """The real tokenizer, also recording every text it encodes (to see what a turn tokenized)."""

    encoded: list[str]

    def encode(self, text: str) -> list[int]:
        self.encoded.append(text)
        return super().encode(text)


def _recording(tok: HFTokenizer) -> RecordingTokenizer:
    tok.__class__ = RecordingTokenizer
    tok.encoded = []  # type: ignore[attr-defined]
    return tok  # type: ignore[return-value]


def test_seed_worked_example(tmp_path: Path) -> None:
    tok = _recording(seed_tokenizer(tmp_path))
    store = SessionStore(tok, verify_template=False)
    sid = store.create("s1")
    tok.encoded.clear()
    plan1 = store.prepare_turn(sid, [{"role": "user", "content": "Hello"}])
    assert plan1.prompt_ids == [101, 102]  # checkpoint C1
    assert tok.encoded == ["Hello"]
    # the policy samples "world!" as [103, 104]; these ids are stored as they are
    res = store.commit_turn(sid, plan1, [103, 104], [-0.5, -0.25], versions=3)
    assert res.message == {"role": "assistant", "content": "world!"}
    # the next request carries the history back; only the new text is tokenized onto C2
    tok.encoded.clear()
    plan2 = store.prepare_turn(sid, [{"role": "user", "content": "Hello"}, res.message,
                                     {"role": "user", "content": " Bye"}])
    assert tok.encoded == [" Bye"]
    assert plan2.prompt_ids == [101, 102, 103, 104, 105, 106]
    assert plan2.num_cached == 4
    store.cancel_turn(sid, plan2)
    (sample,) = store.export(sid)
    assert sample.ids == [101, 102, 103, 104]
    assert sample.prompt_ids == [101, 102] and sample.response_ids == [103, 104]
    assert sample.rollout_logprobs == [-0.5, -0.25] and sample.loss_mask == [1, 1]
    assert sample.versions == [3, 3]


def _tiny(tmp: Path, **kw: object) -> tuple[SessionStore, HFTokenizer]:
    tok = tiny_tokenizer(tmp)
    return SessionStore(tok, **kw), tok  # type: ignore[arg-type]


def _turn(store: SessionStore, tok: HFTokenizer, sid: str, msgs: list[dict], reply: str, version: int = 0):
    plan = store.prepare_turn(sid, msgs)
    ids = tok.encode(reply) + [tok.token_to_id("<|im_end|>")]
    lps = [-0.1 * (i + 1) for i in range(len(ids))]
    res = store.commit_turn(sid, plan, ids, lps, versions=version)
    return plan, res, ids, lps


A = {"role": "user", "content": "A"}
C = {"role": "user", "content": "C"}
D = {"role": "user", "content": "D"}


def test_linear_rejects_divergent_history(tmp_path: Path) -> None:
    store, tok = _tiny(tmp_path, policy="linear")
    sid = store.create()
    _, r1, _, _ = _turn(store, tok, sid, [A], "B")
    _turn(store, tok, sid, [A, r1.message, C], "c")
    with pytest.raises(Diverged, match=r"messages\[2\] \(user\) differs"):
        store.prepare_turn(sid, [A, r1.message, D])
    assert len(store.export(sid)) == 1


def test_branching_forks_and_exports_each_leaf(tmp_path: Path) -> None:
    store, tok = _tiny(tmp_path, policy="branching")
    sid = store.create()
    p1, r1, ids1, _ = _turn(store, tok, sid, [A], "B", version=1)
    p2, _, ids2, _ = _turn(store, tok, sid, [A, r1.message, C], "c", version=2)
    p3, _, ids3, _ = _turn(store, tok, sid, [A, r1.message, D], "d", version=3)
    # both continuations reuse the same stored checkpoint after A→B
    assert p2.prompt_ids[: len(p1.prompt_ids) + len(ids1)] == p1.prompt_ids + ids1
    assert p3.prompt_ids[: p3.num_cached] == p2.prompt_ids[: p2.num_cached]
    s_c, s_d = store.export(sid)
    assert s_c.ids == p2.prompt_ids + ids2 and s_d.ids == p3.prompt_ids + ids3
    assert s_c.metadata["num_turns"] == 2 and store.info(sid)["trajectories"] == 2
    for s, last_ids, v in ((s_c, ids2, 2), (s_d, ids3, 3)):
        assert s.response_ids[-len(last_ids):] == last_ids
        assert s.loss_mask[-len(last_ids):] == [1] * len(last_ids)
        assert s.versions[-1] == v and s.oldest_version() == 1


def test_tool_call_turn_keeps_sampled_ids(tmp_path: Path) -> None:
    store, tok = _tiny(tmp_path)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    sid = store.create(tools=tools)
    user = {"role": "user", "content": "1+2?"}
    plan = store.prepare_turn(sid, [user], tools)
    # the model's compact JSON differs from the template's own rendering of the call
    text = '<tool_call>{"name":"calc","arguments":{"expr":"1+2"}}</tool_call>'
    sampled = tok.encode(text) + [tok.token_to_id("<|im_end|>")]
    res = store.commit_turn(sid, plan, sampled, [-0.2] * len(sampled), versions=5)
    assert res.finish_reason == "tool_calls"
    call = res.message["tool_calls"][0]
    assert call["function"] == {"name": "calc", "arguments": '{"expr": "1+2"}'}
    tool_msg = {"role": "tool", "tool_call_id": call["id"], "content": "3"}
    plan2 = store.prepare_turn(sid, [user, res.message, tool_msg], tools)
    spliced = tok.encode("\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n")
    assert plan2.prompt_ids == plan.prompt_ids + sampled + spliced
    final = tok.encode("3") + [tok.token_to_id("<|im_end|>")]
    store.commit_turn(sid, plan2, final, [-0.3, -0.4], versions=6)
    (s,) = store.export(sid)
    assert s.prompt_ids == plan.prompt_ids
    assert s.response_ids == sampled + spliced + final
    assert s.loss_mask == [1] * len(sampled) + [0] * len(spliced) + [1, 1]
    assert s.rollout_logprobs == [-0.2] * len(sampled) + [0.0] * len(spliced) + [-0.3, -0.4]
    assert s.versions == [5] * len(sampled) + [-1] * len(spliced) + [6, 6]


def test_truncated_turn_is_closed_before_next(tmp_path: Path) -> None:
    store, tok = _tiny(tmp_path)
    sid = store.create()
    plan = store.prepare_turn(sid, [A])
    res = store.commit_turn(sid, plan, tok.encode("abc"), [-1.0] * 3, finish_reason="length")
    assert res.finish_reason == "length"
    plan2 = store.prepare_turn(sid, [A, res.message, C])
    tail = tok.encode("<|im_end|>\n<|im_start|>user\nC<|im_end|>\n<|im_start|>assistant\n")
    assert plan2.prompt_ids == plan.prompt_ids + tok.encode("abc") + tail
    assert store.export(sid)[0].status == "truncated"


def test_match_policies(tmp_path: Path) -> None:
    args_variant = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "calc", "arguments": '{ "expr" : "1+2" }'}}]}
    tool_msg = {"role": "tool", "content": "3"}
    for policy, ok in (("strict", False), ("loose_tool_call", True), ("role_content", True)):
        store, tok = _tiny(tmp_path / policy, match=policy)
        sid = store.create()
        plan = store.prepare_turn(sid, [A])
        text = '<tool_call>{"name": "calc", "arguments": {"expr": "1+2"}}</tool_call>'
        store.commit_turn(sid, plan, tok.encode(text), [0.0] * len(tok.encode(text)))
        req = [A, args_variant, tool_msg]
        if ok:
            assert store.prepare_turn(sid, req).num_cached > 0
        else:
            with pytest.raises(Diverged):
                store.prepare_turn(sid, req)
    # role_content ignores reasoning the client did not send back
    store, tok = _tiny(tmp_path / "rc2", match="role_content")
    sid = store.create()
    plan = store.prepare_turn(sid, [A])
    ids = tok.encode("<think>hm</think>ok")
    res = store.commit_turn(sid, plan, ids, [0.0] * len(ids))
    assert res.message == {"role": "assistant", "content": "ok", "reasoning_content": "hm"}
    assert store.prepare_turn(sid, [A, {"role": "assistant", "content": "ok"}, C]).num_cached > 0


def test_routed_experts_and_versions_concatenate(tmp_path: Path) -> None:
    store, tok = _tiny(tmp_path)
    sid = store.create()
    plan = store.prepare_turn(sid, [A])
    n1 = len(plan.prompt_ids) + 2
    e1 = np.full((n1, 2, 2), 1, np.uint8)  # the whole sequence of turn 1
    r1 = store.commit_turn(sid, plan, tok.encode("hi"), [-0.1, -0.2], routed_experts=e1, versions=[4, 5])
    plan2 = store.prepare_turn(sid, [A, r1.message, C])
    seg = len(plan2.prompt_ids) - plan2.num_cached + 1
    e2 = np.full((seg, 2, 2), 2, np.uint8)  # only the new tokens of turn 2
    store.commit_turn(sid, plan2, tok.encode("x"), [-0.3], routed_experts=e2, versions=6)
    (s,) = store.export(sid)
    assert s.routed_experts is not None and s.routed_experts.shape == (s.num_tokens, 2, 2)
    assert (s.routed_experts[:n1] == 1).all() and (s.routed_experts[n1:] == 2).all()
    assert s.oldest_version() == 4 and s.versions[:2] == [4, 5]


def test_bad_requests_name_the_problem(tmp_path: Path) -> None:
    store, tok = _tiny(tmp_path)
    with pytest.raises(SessionError, match="unknown session 'nope'"):
        store.prepare_turn("nope", [A])
    sid = store.create("s")
    with pytest.raises(SessionError, match="already exists"):
        store.create("s")
    with pytest.raises(SessionError, match=r"messages\[1\]: a system message is only allowed first"):
        store.prepare_turn(sid, [A, {"role": "system", "content": "x"}])
    with pytest.raises(SessionError, match=r"messages\[0\]: a tool message must follow"):
        store.prepare_turn(sid, [{"role": "tool", "content": "x"}])
    with pytest.raises(SessionError, match="last message must be from user or tool"):
        store.prepare_turn(sid, [A, {"role": "assistant", "content": "x"}])
    with pytest.raises(SessionError, match=r"messages\[0\].role: 'bot'"):
        store.prepare_turn(sid, [{"role": "bot", "content": "x"}])
    plan = store.prepare_turn(sid, [A])
    with pytest.raises(SessionError, match="already in flight"):
        store.prepare_turn(sid, [A])
    with pytest.raises(SessionError, match="1 logprobs for 2 sampled"):
        store.commit_turn(sid, plan, [10, 11], [0.0])
    with pytest.raises(SessionError, match="routed_experts has shape"):
        store.commit_turn(sid, plan, [10], [0.0], routed_experts=np.zeros((2, 1, 1), np.uint8))
    store.commit_turn(sid, plan, [10], [0.0])
    with pytest.raises(SessionError, match="no turn .* in flight"):
        store.commit_turn(sid, plan, [10], [0.0])
    store.close(sid)
    assert sid not in store


def _drops_reasoning_dir(tmp: Path) -> Path:
    d = save_tiny_tokenizer(tmp)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = DROPS_REASONING_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_store_refuses_non_append_only_template_unless_fallback(tmp_path: Path) -> None:
    tok = load_tokenizer(_drops_reasoning_dir(tmp_path))
    with pytest.raises(NotAppendOnly, match="reasoning"):
        SessionStore(tok)
    store = SessionStore(tok, template_fallback="anchor_diff")
    sid = store.create()
    plan = store.prepare_turn(sid, [A])
    sampled = tok.encode("<think>r</think>B") + [tok.token_to_id("<|im_end|>")]
    res = store.commit_turn(sid, plan, sampled, [0.0] * len(sampled))
    plan2 = store.prepare_turn(sid, [A, res.message, C])
    # the stored (reasoning-bearing) tokens stay; only the new user turn is spliced on
    assert plan2.prompt_ids == plan.prompt_ids + sampled + tok.encode(
        "\n<|im_start|>user\nC<|im_end|>\n<|im_start|>assistant\n")


def test_local_render_matches_full_render(tmp_path: Path) -> None:
    """The fast path (render the last turn + new messages) gives the same ids as full renders."""
    from miles.rollout.tokens.template_check import check_local_render

    tok = tiny_tokenizer(tmp_path)
    assert check_local_render(tok).ok
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    runs = {}
    for mode in ("full", "local"):
        store = SessionStore(tok, render_mode=mode)
        assert store.local_render == (mode == "local")
        sid = store.create(tools=tools)
        msgs: list[dict] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "2*3?"}]
        replies = ['<tool_call>{"name":"calc","arguments":{"expr":"2*3"}}</tool_call>', "<think>t</think>6",
                   "truncated"]
        plans = []
        for k, reply in enumerate(replies):
            plan = store.prepare_turn(sid, msgs, tools)
            plans.append(plan.prompt_ids)
            end = [] if k == 2 else [tok.token_to_id("<|im_end|>")]
            ids = tok.encode(reply) + end
            res = store.commit_turn(sid, plan, ids, [-0.5] * len(ids), finish_reason="length" if k == 2 else "stop")
            msgs.append(res.message)
            if res.message.get("tool_calls"):
                msgs.append({"role": "tool", "content": "6"})
            else:
                msgs.append({"role": "user", "content": f"next {k}"})
        plans.append(store.prepare_turn(sid, msgs, tools).prompt_ids)
        runs[mode] = plans
    assert runs["full"] == runs["local"]
    whole = tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "2*3?"}], tools, True))
    assert runs["local"][0] == whole


def test_auto_render_mode_is_full_for_non_local_template(tmp_path: Path) -> None:
    # a template that numbers turns depends on the whole history, so it must not render locally
    d = save_tiny_tokenizer(tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ loop.index }}:{{ m.content }}"
                            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(d)
    store = SessionStore(tok)
    assert not store.local_render
    sid = store.create()
    plan = store.prepare_turn(sid, [A])
    r = store.commit_turn(sid, plan, tok.encode("1:x"), [0.0] * 3)
    plan2 = store.prepare_turn(sid, [A, r.message, C])
    assert tok.decode(plan2.prompt_ids).endswith("<|im_start|>user\n3:C<|im_end|>\n<|im_start|>assistant\n")


def test_routing_one_row_short_repeats_its_last_row(tmp_path: Path) -> None:
    """An engine that never feeds the last sampled token (SGLang, an aborted request) has one
    row less; the store repeats the last row for it, so the sample has one row per token."""
    store, tok = _tiny(tmp_path)
    sid = store.create()
    plan = store.prepare_turn(sid, [A])
    n = len(plan.prompt_ids) + 2
    ex = np.arange((n - 1) * 2 * 2, dtype=np.int64).reshape(n - 1, 2, 2).astype(np.uint8)
    store.commit_turn(sid, plan, tok.encode("hi"), [-0.1, -0.2], routed_experts=ex, versions=[1, 1])
    (s,) = store.export(sid)
    assert s.routed_experts is not None and s.routed_experts.shape == (n, 2, 2)
    assert (s.routed_experts[: n - 1] == ex).all() and (s.routed_experts[-1] == ex[-1]).all()
    sid2 = store.create()
    plan = store.prepare_turn(sid2, [A])
    with pytest.raises(SessionError, match="routed_experts has shape"):  # two short: still refused
        store.commit_turn(sid2, plan, tok.encode("hi"), [-0.1, -0.2], routed_experts=ex[:-1])
