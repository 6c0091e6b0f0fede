"""The HTTP front under hostile input: a fuzz run gets only clear 4xx; the bearer token is enforced."""

from __future__ import annotations

import os

import aiohttp
import openai
import pytest

from miles.bench.http_fuzz import run_fuzz, start_front
from miles.core.errors import ConfigError
from miles.sessions.http import SessionHTTP, read_token

pytestmark = pytest.mark.timeout(120)
USER = {"role": "user", "content": "hi"}


async def test_fuzzed_requests_get_clear_4xx_and_the_server_keeps_serving(tmp_path) -> None:
    front = await start_front(tmp_path)
    try:
        res = await run_fuzz(front.url, 300, seed=1, max_huge=1)
    finally:
        await front.stop()
    assert res["n_failures"] == 0, res["failures"]
    assert res["alive"] and res["still_serves"]
    assert res["statuses"].get("served_ok", 0) > 10  # well-formed turns in between were all served
    assert not [s for s in res["statuses"] if s.isdigit() and int(s) >= 500]
    # The cases the fuzz exists for were all generated.
    for kind in ("deep_json", "lone_surrogate", "role_type", "bad_encoding", "temperature", "huge_body",
                 "long_prompt", "truncated_sampling", "create_id", "create_tools", "create_body"):
        assert res["kinds"].get(kind, 0) > 0, kind


async def test_bearer_token_required_when_configured(tmp_path) -> None:
    token = "s3cret-token-0123456789"
    front = await start_front(tmp_path)
    guarded = SessionHTTP(front.service, token=token)
    url = await guarded.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/sessions") as r:
                assert r.status == 401 and "bearer token" in (await r.json())["error"]["message"]
            async with http.post(f"{url}/sessions", headers={"Authorization": "Bearer wrong"}) as r:
                assert r.status == 401
            async with http.get(f"{url}/health") as r:
                assert r.status == 200  # liveness probes need no token
            auth = {"Authorization": f"Bearer {token}"}
            async with http.post(f"{url}/sessions", headers=auth) as r:
                assert r.status == 201
                sid = (await r.json())["session_id"]
        # An OpenAI client sends its api_key as the bearer token.
        oa = openai.AsyncOpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key=token, max_retries=0)
        out = await oa.chat.completions.create(model="policy", messages=[USER], max_tokens=2)  # type: ignore[list-item]
        assert out.choices[0].message.role == "assistant"
        bad = openai.AsyncOpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model="policy", messages=[USER], max_tokens=2)  # type: ignore[list-item]
        await oa.close()
        await bad.close()
    finally:
        await guarded.stop()
        await front.stop()


def test_token_file_must_be_private(tmp_path) -> None:
    p = tmp_path / "token"
    p.write_text("t" * 32 + "\n")
    os.chmod(p, 0o644)
    with pytest.raises(ConfigError, match="0600"):
        read_token(str(p))
    os.chmod(p, 0o600)
    assert read_token(str(p)) == "t" * 32


async def test_concurrent_multi_turn_clients_lose_and_duplicate_no_turn(tmp_path) -> None:
    from miles.bench.session_load import run_load

    front = await start_front(tmp_path)
    try:
        res = await run_load(front.url, 32, turns=3, max_tokens=3)
    finally:
        await front.stop()
    assert res["errors"] == 0, res["first_errors"]
    assert res["turns"] == res["expected_turns"] == 96
