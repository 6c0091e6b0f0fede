"""The token-level routes and chat-completion logprobs of the session front, against a real engine
actor (tiny random model, fp32, CPU): ids exactly the engine's own, logprobs within 1e-6."""

from __future__ import annotations

import json

import aiohttp
import pytest

from miles.actors.messages import Generate
from miles.bench import session_front

from .session_stack import make_tok, tiny_lm, transport_cfg

pytestmark = pytest.mark.timeout(90)
TOKEN = "tok3n-for-the-token-route-0123"
USER = {"role": "user", "content": "count with me: one two"}


@pytest.fixture
async def stack(tmp_path):
    tok = make_tok(tmp_path)
    front = await session_front.start_session_front(tok, [tiny_lm(tok)], transport=transport_cfg(), token=TOKEN)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        yield front, tok, http
    await front.stop()


async def _post(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with http.post(url, json=body) as r:
        return r.status, await r.json()


async def _session(http: aiohttp.ClientSession, url: str) -> str:
    status, body = await _post(http, f"{url}/sessions", {})
    assert status == 201
    return body["session_id"]


async def _engine(front, ids: list[int], sampling: dict) -> dict:
    """The engine's own answer for `ids`, asked directly (no front, no session KV), as a map to
    compare with the token API's JSON."""
    r = await front.host.ref("engine-0").ask(Generate(ids, sampling), timeout=30)
    return {"output_ids": r.output_ids, "logprobs": r.logprobs}


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.7, "seed": 11}])
async def test_token_route_returns_the_engines_ids_and_logprobs(stack, sampling) -> None:
    front, tok, http = stack
    sid = await _session(http, front.url)
    prompt = tok.encode("the token route: ids in, ids out")
    status, out = await _post(http, f"{front.url}/sessions/{sid}/v1/generate",
                              {"input_ids": prompt, "max_tokens": 12, **sampling})
    assert status == 200, out
    want = await _engine(front, prompt, {"max_new_tokens": 12, "stop_token_ids": tok.stop_token_ids, **sampling})
    assert out["output_ids"] == want["output_ids"]
    assert len(out["logprobs"]) == len(want["logprobs"]) == len(out["output_ids"])
    assert max(abs(a - b) for a, b in zip(out["logprobs"], want["logprobs"], strict=True)) <= 1e-6
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert out["usage"]["completion_tokens"] == len(out["output_ids"])
    # a second turn on the same session extends the first: the engine reuses the session's KV
    ids2 = prompt + out["output_ids"] + tok.encode(" more")
    status, out2 = await _post(http, f"{front.url}/sessions/{sid}/v1/generate",
                               {"input_ids": ids2, "max_tokens": 6, "temperature": 0.0})
    assert status == 200 and out2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    want2 = await _engine(front, ids2, {"max_new_tokens": 6, "temperature": 0.0,
                                        "stop_token_ids": tok.stop_token_ids})
    assert out2["output_ids"] == want2["output_ids"]


async def test_chat_logprobs_are_the_engines_and_the_samples(stack) -> None:
    front, tok, http = stack
    sid = await _session(http, front.url)
    status, out = await _post(http, f"{front.url}/sessions/{sid}/v1/chat/completions",
                              {"messages": [USER], "max_tokens": 10, "temperature": 0.0, "logprobs": True,
                               "top_logprobs": 0})
    assert status == 200, out
    content = out["choices"][0]["logprobs"]["content"]
    status, exported = await _post(http, f"{front.url}/sessions/{sid}/samples", {})
    sample = exported["samples"][0]
    assert [c["token_id"] for c in content] == sample["response_ids"]
    assert [c["logprob"] for c in content] == sample["rollout_logprobs"]
    assert all(c["token"] == tok.decode([c["token_id"]]) for c in content)
    want = await _engine(front, sample["prompt_ids"], {"max_new_tokens": 10, "temperature": 0.0,
                                                       "stop_token_ids": tok.stop_token_ids})
    assert [c["token_id"] for c in content] == want["output_ids"]
    assert max(abs(c["logprob"] - w) for c, w in zip(content, want["logprobs"], strict=True)) <= 1e-6
    # /tokenize of the same messages gives the prompt ids the turn sent
    status, t = await _post(http, f"{front.url}/v1/tokenize", {"messages": [USER]})
    assert status == 200 and t["tokens"] == sample["prompt_ids"] and t["count"] == len(t["tokens"])
    status, t = await _post(http, f"{front.url}/sessions/{sid}/v1/tokenize", {"prompt": "one two"})
    assert status == 200 and t["tokens"] == tok.encode("one two")


async def test_chat_logprobs_off_by_default_and_streamed_on_finish(stack) -> None:
    front, _, http = stack
    sid = await _session(http, front.url)
    status, out = await _post(http, f"{front.url}/sessions/{sid}/v1/chat/completions",
                              {"messages": [USER], "max_tokens": 3})
    assert status == 200 and out["choices"][0]["logprobs"] is None
    sid = await _session(http, front.url)
    async with http.post(f"{front.url}/sessions/{sid}/v1/chat/completions",
                         json={"messages": [USER], "max_tokens": 3, "stream": True, "logprobs": True}) as r:
        text = await r.text()
    chunks = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and len(finish[0]["choices"][0]["logprobs"]["content"]) >= 1


@pytest.mark.parametrize("body,where", [
    ({}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, "2"]}, "input_ids[1]"),
    ({"input_ids": [1, True]}, "input_ids[1]"),
    ({"input_ids": [-1]}, "input_ids[0]"),
    ({"input_ids": [10 ** 9]}, "outside the vocabulary"),
    ({"input_ids": [1], "messages": [USER]}, "messages"),
    ({"input_ids": [1], "top_p": 0.5}, "top_p"),
    ({"input_ids": [1], "temperature": 9}, "temperature"),
    ({"input_ids": [1], "top_logprobs": 3}, "top_logprobs"),
    ({"input_ids": [1] * 2000}, "max_seq_len"),
])
async def test_token_route_refuses_bad_input_with_a_clear_400(stack, body, where) -> None:
    front, _, http = stack
    sid = await _session(http, front.url)
    status, out = await _post(http, f"{front.url}/sessions/{sid}/v1/generate", body)
    assert status == 400, out
    assert where in out["error"]["message"]


async def test_new_routes_share_auth_and_session_errors(stack) -> None:
    front, _, http = stack
    async with aiohttp.ClientSession() as anon:
        for path in ("/v1/tokenize", "/sessions/x/v1/generate", "/sessions/x/v1/tokenize"):
            async with anon.post(front.url + path, json={"prompt": "x"}) as r:
                assert r.status == 401
    status, out = await _post(http, f"{front.url}/sessions/nope/v1/generate", {"input_ids": [1]})
    assert status == 404 and "unknown session" in out["error"]["message"]
    for body in ({}, {"prompt": "a", "messages": [USER]}, {"prompt": 3}, {"messages": []}, {"x": 1}):
        status, out = await _post(http, f"{front.url}/v1/tokenize", body)
        assert status == 400 and out["error"]["message"]
    sid = await _session(http, front.url)
    status, out = await _post(http, f"{front.url}/sessions/{sid}/v1/chat/completions",
                              {"messages": [USER], "logprobs": 1})
    assert status == 400 and "logprobs" in out["error"]["message"]
