"""The real `openai` client drives tool-calling sessions through the HTTP front against the
embedded engine over the rollout's session path (session service → EngineRequests + Dispatch →
engine actor); the exported sample carries exactly the engine's sampled ids, turn by turn."""

from __future__ import annotations

import json

import pytest
from openai import AsyncOpenAI

from miles.actors.messages import Generate
from miles.rollout.envs.calculator import CALC_TOOL
from miles.rollout.envs.openai_agent import run_openai_tool_loop

from .http_client import RemoteSessionClient
from .session_stack import (
    ANSWER,
    QUESTION,
    make_tok,
    start_stack,
    tool_calling_lm,
    tool_conversation,
)

pytestmark = pytest.mark.timeout(60)


def _segments(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) runs of 1s in a loss mask: the spans the policy sampled."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.fixture
async def stack(tmp_path):
    tok = make_tok(tmp_path)
    s = await start_stack(tok, [tool_calling_lm(tok)])
    yield s, tok
    await s.stop()


async def test_openai_agent_tool_loop_exports_the_engine_ids(stack) -> None:
    s, tok = stack
    client = RemoteSessionClient(s.url)
    try:
        sid = await client.create_session(tools=[CALC_TOOL], metadata={"case": "openai"})
        base = client.base_url(sid)
        assert base == f"{s.url}/sessions/{sid}/v1"
        # The env's black-box agent: plain AsyncOpenAI code, calc tool executed between turns.
        out = await run_openai_tool_loop(base, [{"role": "user", "content": QUESTION}], max_turns=4,
                                         temperature=0.0, max_tokens=80)
        assert out["turns"] == 2 and out["finish_reason"] == "stop"
        assert out["response"] == f"The answer is {ANSWER}."
        info = await client.info(sid)
        assert info["turns"] == 2 and info["trajectories"] == 1
        (sample,) = await client.export(sid)
    finally:
        await client.aclose()
    assert sample.metadata["session_id"] == sid and sample.metadata["case"] == "openai"
    # TITO: the token ids are the whole conversation as the template renders it ...
    msgs = tool_conversation()
    rendered = tok.encode(tok.apply_chat_template(msgs, [CALC_TOOL]))
    assert sample.ids == rendered[:-1]  # all but the template's "\n" after the last <|im_end|>
    # ... and each sampled span is exactly what the engine samples for the prompt before it.
    segs = _segments(sample.loss_mask)
    assert len(segs) == 2
    stop = tok.stop_token_ids
    for a, b in segs:
        prompt = sample.prompt_ids + sample.response_ids[:a]
        r = await s.host.ref("engine-0").ask(
            Generate(prompt, {"temperature": 0.0, "max_new_tokens": 80, "stop_token_ids": stop}), timeout=30)
        assert r.output_ids == sample.response_ids[a:b]
        assert r.logprobs == pytest.approx(sample.rollout_logprobs[a:b], abs=1e-4)
    first = tok.decode(sample.response_ids[segs[0][0]:segs[0][1]])
    assert first.startswith("<tool_call>") and json.loads(first[11:first.index("</tool_call>")]) == {
        "name": "calc", "arguments": {"expr": "12*3+4"}}
    # Both turns went through the dispatch under the session's one routing key, held until close.
    assert s.dispatch.counters.requests == {"engine-0": 2}
    assert s.dispatch.state()["keys_held"] == 1


async def test_streaming_with_the_openai_client(stack) -> None:
    s, _ = stack
    client = RemoteSessionClient(s.url)
    sid = await client.create_session(tools=[CALC_TOOL])
    oa = AsyncOpenAI(base_url=client.base_url(sid), api_key="x")
    try:
        stream = await oa.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": QUESTION}], tools=[CALC_TOOL],  # type: ignore[list-item]
            temperature=0.0, max_tokens=80, stream=True, stream_options={"include_usage": True})
        calls: dict[int, dict[str, str]] = {}
        finish, usage, roles = None, None, []
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                if ch.delta.role:
                    roles.append(ch.delta.role)
                for tc in ch.delta.tool_calls or []:
                    c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    c["name"] += tc.function.name or ""
                    c["arguments"] += tc.function.arguments or ""
                finish = ch.finish_reason or finish
        assert roles == ["assistant"] and finish == "tool_calls"
        assert calls[0]["name"] == "calc" and json.loads(calls[0]["arguments"]) == {"expr": "12*3+4"}
        assert usage is not None and usage.completion_tokens > 0
        # The same session continues non-streaming after the streamed turn.
        info = await client.info(sid)
        assert info["turns"] == 1
    finally:
        await oa.close()
        await client.close(sid)
        await client.aclose()


async def test_close_releases_the_sessions_routing_key(stack) -> None:
    s, _ = stack
    client = RemoteSessionClient(s.url)
    try:
        sid = await client.create_session(tools=[CALC_TOOL])
        reply = await client.chat(sid, [{"role": "user", "content": QUESTION}], [CALC_TOOL],
                                  {"temperature": 0.0, "max_new_tokens": 80})
        assert reply["finish_reason"] == "tool_calls"
        (call,) = reply["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"expr": "12*3+4"}
        (sample,) = await client.export(sid)
        assert sample.num_sampled == reply["usage"]["completion_tokens"]
        assert s.dispatch.state()["keys_held"] == 1
        await client.close(sid)
        # closing the session released its key: the dispatch holds nothing, one group routed unsplit
        st = s.dispatch.state()
        assert st["keys_held"] == 0 and st["groups_routed"] == 1 and st["groups_split"] == 0
        with pytest.raises(Exception, match="unknown session"):
            await client.export(sid)
    finally:
        await client.aclose()
