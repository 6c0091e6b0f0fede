"""The rollout's one-turn path gives the sample a one-turn session gives.

The rollout actor skips the session store for the default single-turn agent
(`SessionStore.prepare_one` / `commit_one`): for every kind of reply (stop, length, a
tool call, reasoning, routed experts, per-token versions, a bad engine output) its sample
must equal what `default_generate` running `single_turn_agent` over a session exports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from miles.core.errors import SessionError
from miles.rollout.layers import GenerateContext, default_generate, single_turn_agent
from miles.rollout.tito.client import EngineOutput, LocalSessionClient
from miles.rollout.tito.store import SessionStore
from miles.rollout.tokens.tiny_tokenizer import tiny_tokenizer
from miles.rollout.tokens.tokenizer import HFTokenizer
from miles.rollout.types import Sample

pytestmark = pytest.mark.timeout(60)

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


def _cases(tok: HFTokenizer) -> list[tuple[str, list[dict[str, Any]], Any, Any]]:
    end = tok.token_to_id("<|im_end|>")
    user = [{"role": "user", "content": "2+3="}]
    with_system = [{"role": "system", "content": "Be brief."}, *user]

    def out(text: str, finish: str = "stop", stop: bool = True, versions: Any = 4, experts: bool = False,
            n_prompt: int = 0) -> EngineOutput:
        ids = tok.encode(text) + ([end] if stop else [])
        routed = (np.arange((n_prompt + len(ids)) * 2 * 2, dtype=np.uint8).reshape(-1, 2, 2)
                  if experts else None)
        vers = versions if isinstance(versions, int) else [versions + i for i in range(len(ids))]
        return EngineOutput(ids, [-0.1 * (i + 1) for i in range(len(ids))], finish, vers, routed)

    return [
        ("stop", user, None, lambda n: out("5", n_prompt=n)),
        ("length", user, None, lambda n: out("55555", "length", stop=False)),
        ("system prompt, versions per token", with_system, None, lambda n: out("5", versions=2)),
        ("reasoning", user, None, lambda n: out("<think>add</think>5")),
        ("tool call", user, TOOLS, lambda n: out('<tool_call>{"name":"calc","arguments":{"e":"2+3"}}</tool_call>')),
        ("routed experts of the whole sequence", user, None, lambda n: out("5", experts=True, n_prompt=n)),
        ("abort", user, None, lambda n: out("5", "abort", stop=False)),
    ]


def _without_session(s: Sample) -> dict[str, Any]:
    d = s.to_wire()
    d.pop("routed_experts", None)  # an array: compared on its own
    d["metadata"] = {k: v for k, v in d["metadata"].items() if k != "session_id"}
    return d


async def _through_session(store: SessionStore, prompt: dict[str, Any], tools: Any, reply: Any,
                           sampling: dict[str, Any]) -> tuple[list[Sample], list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    async def engine(ids: list[int], params: dict[str, Any]) -> EngineOutput:
        seen.append({"ids": ids, "sampling": params})
        return reply(len(ids))

    ctx = GenerateContext(LocalSessionClient(store, engine), prompt, single_turn_agent, tools, sampling, 0, 1)
    return await default_generate(ctx), seen


@pytest.mark.parametrize("case", range(7))
async def test_one_turn_sample_equals_the_sessions(tmp_path: Path, case: int) -> None:
    tok = tiny_tokenizer(tmp_path)
    store = SessionStore(tok)
    name, messages, tools, reply = _cases(tok)[case]
    prompt = {"id": f"p-{case}", "messages": messages}
    sampling = {"max_new_tokens": 6}
    (want,), seen = await _through_session(store, prompt, tools, reply, sampling)
    assert len(store) == 0  # the session was closed

    turn = store.prepare_one(messages, tools, {"prompt_id": prompt["id"]})
    assert turn.prompt_ids == seen[0]["ids"], name
    out = reply(len(turn.prompt_ids))
    got, message, finish = store.commit_one(turn, out.ids, out.logprobs, out.routed_experts, out.version,
                                            out.finish_reason)
    got.metadata.update({"response": message.get("content", ""), "finish_reason": finish})
    assert _without_session(got) == _without_session(want), name
    assert "session_id" in want.metadata and "session_id" not in got.metadata
    if want.routed_experts is not None:
        assert got.routed_experts is not None and np.array_equal(got.routed_experts, want.routed_experts)
    assert len(store) == 0  # nothing stored


def test_bad_engine_output_is_refused_as_a_session_turn_refuses_it(tmp_path: Path) -> None:
    tok = tiny_tokenizer(tmp_path)
    store = SessionStore(tok)
    msgs = [{"role": "user", "content": "1+1="}]
    turn = store.prepare_one(msgs)
    with pytest.raises(SessionError, match="1 logprobs for 2 sampled tokens"):
        store.commit_one(turn, [5, 6], [-0.1])
    with pytest.raises(SessionError, match="finish_reason 'weird'"):
        store.commit_one(turn, [5], [-0.1], finish_reason="weird")
    with pytest.raises(SessionError, match="routed_experts has shape"):
        store.commit_one(turn, [5], [-0.1], routed_experts=np.zeros((2, 1, 1), dtype=np.int32))
    with pytest.raises(SessionError, match="last message must be from user or tool"):
        store.prepare_one([*msgs, {"role": "assistant", "content": "2"}])
