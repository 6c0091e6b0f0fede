"""A client of the session HTTP front for the tests: the endpoints a black-box OpenAI agent uses,
plus create / info / export / close, with the front's JSON errors raised as miles errors."""

from __future__ import annotations

from typing import Any

import aiohttp

from miles.core.errors import KNOWN_ERRORS, MilesError, SessionError
from miles.rollout.types import Sample
from miles.sessions.openai_api import sample_from_json

# engine sampling key -> OpenAI request field (top_k and stop_token_ids are server extensions)
_TO_OPENAI = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
              "max_new_tokens": "max_tokens", "max_tokens": "max_tokens", "stop_token_ids": "stop_token_ids"}


def _raise_for(status: int, body: Any, what: str) -> None:
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        raise SessionError(f"{what}: HTTP {status}: {str(body)[:200]}")
    cls = KNOWN_ERRORS.get(str(err.get("type")), SessionError if status < 500 else MilesError)
    raise cls(f"{what}: HTTP {status}: {err.get('message')}")


class RemoteSessionClient:
    """`SessionClient` over the session server's HTTP front at `url` (e.g. http://127.0.0.1:8000)."""

    def __init__(self, url: str, timeout_s: float = 300.0, model: str = "policy") -> None:
        self.url = url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.model = model
        self._http: aiohttp.ClientSession | None = None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=self.timeout)
        return self._http

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        async with self._session().request(method, self.url + path, json=body) as r:
            data = await r.json(content_type=None)
            if r.status >= 400:
                _raise_for(r.status, data, f"{method} {path}")
            return data

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def create_session(self, tools: list[dict[str, Any]] | None = None,
                             metadata: dict[str, Any] | None = None) -> str:
        d = await self._call("POST", "/sessions", {"tools": tools, "metadata": metadata or {}})
        return str(d["session_id"])

    async def chat(self, session_id: str, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None = None,
                   sampling: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if tools is not None:
            body["tools"] = tools
        for k, v in (sampling or {}).items():
            if k not in _TO_OPENAI:
                raise SessionError(f"sampling: unknown key {k!r}; valid: {sorted(_TO_OPENAI)}")
            body[_TO_OPENAI[k]] = v
        d = await self._call("POST", f"/sessions/{session_id}/v1/chat/completions", body)
        choice, usage = d["choices"][0], d["usage"]
        message = {k: v for k, v in choice["message"].items() if v is not None}
        return {"message": message, "finish_reason": choice["finish_reason"],
                "usage": {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
                          "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}}

    async def info(self, session_id: str) -> dict[str, Any]:
        d: dict[str, Any] = await self._call("GET", f"/sessions/{session_id}")
        return d

    async def export(self, session_id: str) -> list[Sample]:
        d = await self._call("POST", f"/sessions/{session_id}/samples")
        return [sample_from_json(s, f"samples[{i}]") for i, s in enumerate(d["samples"])]

    async def close(self, session_id: str) -> None:
        await self._call("DELETE", f"/sessions/{session_id}")

    def base_url(self, session_id: str) -> str | None:
        return f"{self.url}/sessions/{session_id}/v1"
