"""Bad input to the HTTP front: 4xx with a JSON error naming the problem; the server stays up."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest

pytestmark = pytest.mark.timeout(60)
USER = {"role": "user", "content": "hi"}


async def _req(http: aiohttp.ClientSession, method: str, url: str, body: Any = None,
               raw: bytes | None = None) -> tuple[int, Any]:
    kw: dict[str, Any] = {"data": raw} if raw is not None else {"json": body}
    async with http.request(method, url, **kw) as r:
        return r.status, await r.json(content_type=None)


async def _new_session(http: aiohttp.ClientSession, url: str) -> str:
    status, d = await _req(http, "POST", f"{url}/sessions")
    assert status == 201
    return str(d["session_id"])


def _error(status: int, d: Any, want_status: int, *needles: str) -> None:
    assert status == want_status, d
    err = d["error"]
    assert err["code"] == want_status and isinstance(err["type"], str)
    for n in needles:
        assert n in err["message"], (n, err["message"])


async def test_unknown_session_routes_and_methods(served) -> None:
    s, http = served
    u = s.url
    for method, path in [("GET", "/sessions/nope"), ("DELETE", "/sessions/nope"),
                         ("POST", "/sessions/nope/samples"), ("POST", "/sessions/nope/v1/chat/completions")]:
        status, d = await _req(http, method, u + path, {"messages": [USER]})
        _error(status, d, 404, "unknown session 'nope'")
    status, d = await _req(http, "GET", u + "/no/such/route")
    _error(status, d, 404, "/no/such/route")
    status, d = await _req(http, "PUT", u + "/sessions")
    _error(status, d, 405, "PUT /sessions")
    status, d = await _req(http, "POST", u + "/sessions", {"bogus": 1})
    _error(status, d, 400, "unknown field(s) ['bogus']")
    # the openai client surfaces the server's message
    oa = openai.AsyncOpenAI(base_url=f"{u}/sessions/nope/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="unknown session 'nope'"):
        await oa.chat.completions.create(model="policy", messages=[USER])  # type: ignore[list-item]
    await oa.close()


BAD_CHATS: list[tuple[Any, str]] = [
    ([], "request body: expected a JSON object"),
    ({}, "messages: missing"),
    ({"messages": "hi"}, "messages: expected a non-empty list"),
    ({"messages": []}, "messages: expected a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role: 'robot'"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [USER, {"role": "tool", "content": "3"}]}, "messages[1]: a tool message must follow"),
    ({"messages": [USER, {"role": "system", "content": "s"}, USER]}, "messages[1]: a system message is only"),
    ({"messages": [USER, {"role": "assistant", "content": "a"}]}, "the last message must be from user or tool"),
    ({"messages": [USER], "temperature": "hot"}, "temperature: expected a number"),
    ({"messages": [USER], "max_tokens": 0}, "max_tokens: expected an integer >= 1"),
    ({"messages": [USER], "n": 3}, "n: only 1 choice"),
    ({"messages": [USER], "stop": ["\n"]}, "stop: stop strings are not supported"),
    ({"messages": [USER], "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": [USER], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [USER], "stream": "yes"}, "stream: expected true or false"),
]


async def test_malformed_chat_bodies_and_wrong_role_order(served) -> None:
    s, http = served
    sid = await _new_session(http, s.url)
    chat = f"{s.url}/sessions/{sid}/v1/chat/completions"
    status, d = await _req(http, "POST", chat, raw=b"{not json")
    _error(status, d, 400, "not valid JSON")
    status, d = await _req(http, "POST", chat, raw=b"")
    _error(status, d, 400, "empty")
    for body, needle in BAD_CHATS:
        status, d = await _req(http, "POST", chat, body)
        _error(status, d, 400, needle)
    # none of that touched the session: a good request still works and is turn 1
    status, d = await _req(http, "POST", chat, {"messages": [USER], "max_tokens": 4})
    assert status == 200 and d["choices"][0]["message"]["role"] == "assistant"
    status, info = await _req(http, "GET", f"{s.url}/sessions/{sid}")
    assert status == 200 and info["turns"] == 1


async def test_divergence_engine_refusal_and_server_stays_up(served) -> None:
    s, http = served
    sid = await _new_session(http, s.url)
    chat = f"{s.url}/sessions/{sid}/v1/chat/completions"
    status, d = await _req(http, "POST", chat, {"messages": [USER], "max_tokens": 4})
    assert status == 200
    reply = d["choices"][0]["message"]
    # a linear session refuses a history that rewrites a stored message
    other = {"role": "user", "content": "a different first message"}
    status, e = await _req(http, "POST", chat, {"messages": [other, reply, USER], "max_tokens": 4})
    _error(status, e, 409, "messages[0] (user) differs")
    # the engine refuses a prompt longer than its max_seq_len: the client's mistake, a 400 naming
    # it, and the turn is cancelled
    huge = {"role": "user", "content": "x" * 1500}
    status, e = await _req(http, "POST", chat, {"messages": [USER, reply, huge], "max_tokens": 4})
    _error(status, e, 400, "max_seq_len")
    assert e["error"]["type"] == "BadRequest"
    status, d = await _req(http, "POST", chat, {"messages": [USER, reply, USER], "max_tokens": 4})
    assert status == 200
    status, h = await _req(http, "GET", f"{s.url}/health")
    assert status == 200 and h["status"] == "ok" and h["turns"] == 2
    status, d = await _req(http, "DELETE", f"{s.url}/sessions/{sid}")
    assert status == 200 and d["closed"] is True
    status, d = await _req(http, "DELETE", f"{s.url}/sessions/{sid}")
    _error(status, d, 404, "unknown session")
