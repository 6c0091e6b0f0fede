"""The async interface the rollout layers use to talk to a session, and an in-process one.

`SessionClient` is what agents and the generate layer call; the session
server's client (over HTTP/actors) implements it for real runs. `LocalSessionClient`
implements it in-process over a `SessionStore` and an engine function
(prompt ids → sampled ids), for single-process runs and tests.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from miles.rollout.tito.store import SessionStore
from miles.rollout.types import Sample


@dataclass
class EngineOutput:
    ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"  # stop | length | abort | error
    version: int | list[int] = 0
    routed_experts: np.ndarray | None = None
    cached_tokens: int = 0  # prompt tokens whose KV the engine reused (a session's earlier turns)


# (prompt ids, sampling) -> output; a VL turn also passes `images=` (an ImageInput), a turn of a
# client with engine sessions `session=` (the session id, the engine's key for the turn's KV)
EngineFn = Callable[..., Awaitable[EngineOutput]]
EndSessionFn = Callable[[str], Awaitable[None]]  # session id -> its engines free its KV (never raises)


@runtime_checkable
class SessionClient(Protocol):
    async def create_session(self, tools: list[dict[str, Any]] | None = None,
                             metadata: dict[str, Any] | None = None) -> str: ...

    async def chat(self, session_id: str, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None = None,
                   sampling: dict[str, Any] | None = None) -> dict[str, Any]:
        """One turn; returns {"message": OpenAI assistant message, "finish_reason": str,
        "usage": {"prompt_tokens", "completion_tokens", "cached_tokens"}}."""
        ...

    async def export(self, session_id: str) -> list[Sample]: ...

    async def close(self, session_id: str) -> None: ...

    def base_url(self, session_id: str) -> str | None:
        """OpenAI-compatible base URL of the session (None when only in-process)."""
        ...


class LocalSessionClient:
    """`SessionClient` over an in-process `SessionStore` and an engine function.

    With `end_session`, every turn passes its session id to the engine as the session key, so
    the engine keeps the turn's KV and the next turn prefills only what the session appended;
    closing the session calls `end_session` (its engines free that KV). Without it, each turn
    prefills its whole context."""

    def __init__(self, store: SessionStore, engine: EngineFn, end_session: EndSessionFn | None = None) -> None:
        self.store = store
        self.engine = engine
        self.end_session = end_session

    async def create_session(self, tools: list[dict[str, Any]] | None = None,
                             metadata: dict[str, Any] | None = None) -> str:
        return self.store.create(tools=tools, metadata=metadata)

    async def chat(self, session_id: str, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None = None,
                   sampling: dict[str, Any] | None = None) -> dict[str, Any]:
        plan = self.store.prepare_turn(session_id, messages, tools, sampling)
        try:
            extra: dict[str, Any] = {} if plan.images is None else {"images": plan.images}  # a VL turn's
            if self.end_session is not None:
                extra["session"] = session_id
            out = await self.engine(plan.prompt_ids, dict(sampling or {}), **extra)
        except BaseException:
            self.store.cancel_turn(session_id, plan)
            raise
        res = self.store.commit_turn(session_id, plan, out.ids, out.logprobs, out.routed_experts,
                                     out.version, out.finish_reason)
        return {"message": res.message, "finish_reason": res.finish_reason,
                "usage": {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
                          "cached_tokens": out.cached_tokens}}

    async def export(self, session_id: str) -> list[Sample]:
        return self.store.export(session_id)

    async def close(self, session_id: str) -> None:
        self.store.close(session_id)
        if self.end_session is not None:
            await self.end_session(session_id)

    def base_url(self, session_id: str) -> str | None:
        return None


class FrontedClient(LocalSessionClient):
    """In-process session client whose sessions are also reachable over the session HTTP front.

    `close_session`: the front's own close (the session service's), so a session whose turns
    went over HTTP also ends on its engines (their KV freed) when the generate layer closes it."""

    def __init__(self, store: SessionStore, engine: EngineFn, url: str, token: str = "",
                 close_session: Callable[[str], Awaitable[None]] | None = None,
                 end_session: EndSessionFn | None = None) -> None:
        super().__init__(store, engine, end_session)
        self.url = url
        self.api_key = token  # the front's bearer token: what an OpenAI client sends as its api_key
        self.close_session = close_session

    async def close(self, session_id: str) -> None:
        if self.close_session is None:
            self.store.close(session_id)
        else:
            await self.close_session(session_id)  # ends the KV of the session's HTTP turns
        if self.end_session is not None:
            await self.end_session(session_id)  # ... and of its in-process ones (a no-op when none)

    def base_url(self, session_id: str) -> str | None:
        return f"{self.url}/sessions/{session_id}/v1"
