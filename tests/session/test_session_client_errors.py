"""Client mistakes at the session front are 4xx naming them, never 5xx; every session id the
front accepts at create is reachable at the base_url it returns (issue 36)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from miles.core.errors import BadRequest, EngineError
from miles.rollout.tito.store import check_session_id

pytestmark = pytest.mark.timeout(90)
USER = {"role": "user", "content": "hi"}


async def _post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as r:
        return r.status, await r.json(content_type=None)


async def test_a_prompt_longer_than_max_seq_len_is_a_400_naming_it(served) -> None:
    s, http = served
    _, d = await _post(http, f"{s.url}/sessions", {})
    long = {"role": "user", "content": "x " * 2000}
    status, err = await _post(http, d["base_url"] + "/chat/completions", {"messages": [long], "max_tokens": 2})
    assert status == 400, err
    assert err["error"]["type"] == "BadRequest" and "max_seq_len=1024" in err["error"]["message"]
    # the session is as it was: a fitting turn is served
    status, ok = await _post(http, d["base_url"] + "/chat/completions", {"messages": [USER], "max_tokens": 2})
    assert status == 200, ok


async def test_truncated_sampling_is_a_400(served) -> None:
    s, http = served
    for extra in ({"top_p": 0.5}, {"top_k": 3}):
        _, d = await _post(http, f"{s.url}/sessions", {})
        status, err = await _post(http, d["base_url"] + "/chat/completions",
                                  {"messages": [USER], "max_tokens": 2, **extra})
        assert status == 400 and "truncated sampling" in err["error"]["message"], err


@pytest.mark.parametrize("sid", ["ok-id_1.2~", "A9", "q..r", "z."])
async def test_an_accepted_id_is_reachable_at_its_base_url(served, sid: str) -> None:
    s, http = served
    status, d = await _post(http, f"{s.url}/sessions", {"session_id": sid})
    assert status == 201 and d["session_id"] == sid and d["base_url"].endswith(f"/sessions/{sid}/v1")
    status, out = await _post(http, d["base_url"] + "/chat/completions", {"messages": [USER], "max_tokens": 2})
    assert status == 200, out


@pytest.mark.parametrize("sid", ["a/b", "..", ".", "a b", "a?b", "a#b", "%2F", "\u00fc", "x" * 129, "-a", ""])
async def test_an_unreachable_id_is_refused_at_create(served, sid: str) -> None:
    s, http = served
    status, d = await _post(http, f"{s.url}/sessions", {"session_id": sid, "routing_key": "k"})
    if sid == "":  # empty = a generated id
        assert status == 201
        return
    assert status == 400 and "cannot be a URL path segment" in d["error"]["message"], d


async def test_bad_tools_are_refused_at_create(served) -> None:
    s, http = served
    for tools in ([1], [{"type": "function"}], [{"type": "function", "function": {"name": 5}}], "x"):
        status, d = await _post(http, f"{s.url}/sessions", {"tools": tools})
        assert status == 400 and "tools" in d["error"]["message"], d


def test_engine_refusals_are_bad_requests_and_ids_are_checked() -> None:
    assert issubclass(BadRequest, EngineError)  # the rollout side still counts them as engine failures
    assert check_session_id("sess-0123") == "sess-0123"
    with pytest.raises(Exception, match="URL path segment"):
        check_session_id(5)
