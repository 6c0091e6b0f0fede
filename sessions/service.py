"""The session server's logic without sockets: a `SessionStore` plus an engine call.

One chat turn = prepare (tokenize only the appended messages) → engine call with
the session's routing key (so the router keeps the session on one engine) and its
session id as the engine's session key (so that engine keeps the turn's KV and the
next turn prefills only its new tokens) → commit the sampled ids as they are. A failed
engine call cancels the prepared turn, so the session stays as it was. Closing a
session ends it on its engines (`EndSession` frees the KV) and, with the last open
session of its routing key, releases that key (through `end_session`). The HTTP front
(sessions/http.py) calls this class; `RoutedEngine` is its engine call in the rollout
process.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from miles.core.errors import MilesError, SessionError
from miles.core.images import ImageInput
from miles.core.logging import get_logger
from miles.rollout.routing.requests import EngineRequests
from miles.rollout.tito.store import SessionStore
from miles.rollout.types import Sample

log = get_logger("miles.session")

# (routing key, prompt ids, sampling, session=session id) -> the engine's result dict (output_ids,
# logprobs, finish_reason, versions, cached_tokens, routed_experts); a VL turn also passes `images=`
EngineCall = Callable[..., Awaitable[dict[str, Any]]]
# (session id, routing key, release): the session closed; `release`: it was the routing key's last
EndSessionCall = Callable[[str, str, bool], Awaitable[Any]]
SAMPLING_KEYS = frozenset({"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "seed"})


def check_sampling(sampling: Any, where: str = "sampling") -> dict[str, Any]:
    if not isinstance(sampling, dict):
        raise SessionError(f"{where}: expected an object, got {type(sampling).__name__}")
    unknown = set(sampling) - SAMPLING_KEYS
    if unknown:
        raise SessionError(f"{where}: unknown key(s) {sorted(unknown)}; valid: {sorted(SAMPLING_KEYS)}")
    return dict(sampling)


class RoutedEngine:
    """The service's engine call over the rollout's `EngineRequests`: the same routed,
    retract-aware path as in-process turns, with the session id as the engine session key;
    `end_session` frees the session's KV on its engines and releases its routing key."""

    def __init__(self, requests: EngineRequests) -> None:
        self.requests = requests

    async def __call__(self, key: str, ids: list[int], sampling: dict[str, Any],
                       images: ImageInput | None = None, session: str | None = None) -> dict[str, Any]:
        out = await self.requests.call(key, ids, sampling, images, session)
        return {"output_ids": out.ids, "logprobs": out.logprobs, "finish_reason": out.finish_reason,
                "versions": out.version, "routed_experts": out.routed_experts, "cached_tokens": out.cached_tokens}

    async def end_session(self, session: str, key: str, release: bool) -> None:
        await self.requests.end_session(session)
        if release:
            await self.requests.release(key)


class SessionService:
    """Sessions over one store; `engine` runs a turn, `end_session` frees a session's KV."""

    def __init__(self, store: SessionStore, engine: EngineCall, end_session: EndSessionCall | None = None,
                 sampling: dict[str, Any] | None = None) -> None:
        self.store = store
        self.engine = engine
        self.end_session = end_session
        # The defaults every turn starts from: stop at the tokenizer's end-of-turn ids.
        self.sampling = {"stop_token_ids": list(store.tok.stop_token_ids),
                         **check_sampling(sampling or {}, "default sampling")}
        self._keys: dict[str, str] = {}  # session id -> routing key, for sessions the engines saw
        self.turns = 0
        self.cached_tokens = 0
        self.prompt_tokens = 0

    def create(self, tools: list[dict[str, Any]] | None = None, metadata: dict[str, Any] | None = None,
               session_id: str = "", routing_key: str = "") -> str:
        return self.store.create(session_id or None, routing_key or None, tools, metadata)

    def exists(self, session_id: str) -> bool:
        return session_id in self.store

    async def chat(self, session_id: str, messages: Any, tools: list[dict[str, Any]] | None = None,
                   sampling: dict[str, Any] | None = None) -> dict[str, Any]:
        """One turn; returns {"message", "finish_reason", "usage"} (see rollout/tito/client.py)."""
        params = {**self.sampling, **check_sampling(sampling or {})}
        plan = self.store.prepare_turn(session_id, messages, tools, params)
        self._keys.setdefault(session_id, plan.routing_key)  # before the call: a failed turn may have reached an engine
        try:
            # images only when the turn has some: text-only engine functions keep their signature
            extra = {} if plan.images is None else {"images": plan.images}
            r = await self.engine(plan.routing_key, plan.prompt_ids, params, session=session_id, **extra)
        except BaseException:
            self.store.cancel_turn(session_id, plan)
            raise
        experts = r.get("routed_experts")
        res = self.store.commit_turn(session_id, plan, r["output_ids"], r["logprobs"],
                                     None if experts is None else np.asarray(experts),
                                     r.get("versions", 0), r["finish_reason"])
        cached = int(r.get("cached_tokens", 0))
        self.turns += 1
        self.prompt_tokens += res.prompt_tokens
        self.cached_tokens += cached
        return {"message": res.message, "finish_reason": res.finish_reason,
                "usage": {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
                          "cached_tokens": cached},
                # the engine's sampled ids and their logprobs, as the session stored them
                "output_ids": list(r["output_ids"]), "logprobs": [float(x) for x in r["logprobs"]]}

    async def generate(self, session_id: str, input_ids: list[int],
                       sampling: dict[str, Any] | None = None) -> dict[str, Any]:
        """A token-level turn (sessions/token_api.py): `input_ids` to the session's engine under its
        routing key and engine session key; the engine's result as it is. Not recorded in the
        session's history. Truncated sampling is refused as on chat turns (one rule for samples)."""
        params = {**self.sampling, **check_sampling(sampling or {})}
        self.store.turn_temperature(params)
        key = self.store.routing_key(session_id)
        self._keys.setdefault(session_id, key)  # the engine may keep KV under the session: end it at close
        r = await self.engine(key, list(input_ids), params, session=session_id)
        cached = int(r.get("cached_tokens", 0))
        self.turns += 1
        self.prompt_tokens += len(input_ids)
        self.cached_tokens += cached
        return {"output_ids": list(r["output_ids"]), "logprobs": [float(x) for x in r["logprobs"]],
                "finish_reason": r["finish_reason"], "versions": r.get("versions", 0), "cached_tokens": cached}

    def tokenize(self, messages: list[Any] | None = None, tools: list[dict[str, Any]] | None = None,
                 prompt: str | None = None) -> list[int]:
        """The prompt ids a session's first chat turn with `messages` sends; or `prompt` encoded."""
        if prompt is not None:
            return self.store.tok.encode(prompt)
        return self.store.prepare_one(messages, tools).prompt_ids

    def info(self, session_id: str) -> dict[str, Any]:
        return self.store.info(session_id)

    def export(self, session_id: str) -> list[Sample]:
        return self.store.export(session_id)

    async def close(self, session_id: str) -> None:
        self.store.close(session_id)
        key = self._keys.pop(session_id, None)
        if key is None:
            return
        if self.end_session is not None:
            try:
                # the routing key stays pinned while another open session shares it
                await self.end_session(session_id, key, key not in self._keys.values())
            except MilesError as exc:  # the engine KV is only a cache; the session is closed anyway
                log.warning("end_session_failed", session=session_id, error=f"{type(exc).__name__}: {exc}")

    def stats(self) -> dict[str, Any]:
        return {"sessions": len(self.store), "turns": self.turns, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "prefix_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0}
