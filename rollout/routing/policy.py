"""Router policy: session affinity, least-loaded placement and prefix-cache accounting.

A session's stable routing key maps to one engine, so each turn lands where the
session's KV cache lives. A key seen for the first time (or every request, with
affinity off) goes to the engine with the fewest in-flight tokens. Removing an
engine moves its sessions to the remaining ones. Engines report how many prompt
tokens they served from their prefix cache; the router sums that into the hit rate.
Plain class; the rollout's dispatch (rollout/routing/dispatch.py) holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles.core.errors import EngineError


@dataclass
class EngineLoad:
    in_flight_tokens: int = 0
    in_flight_requests: int = 0
    sessions: set[str] = field(default_factory=set)
    prompt_tokens: int = 0
    cached_tokens: int = 0


class RouterPolicy:
    def __init__(self, engines: list[str] | None = None, affinity: bool = True) -> None:
        self.affinity = affinity
        self._engines: dict[str, EngineLoad] = {}
        self._key_to_engine: dict[str, str] = {}
        self._order = 0  # tie-break: engines in the order they were added
        for e in engines or []:
            self.add_engine(e)

    @property
    def engines(self) -> list[str]:
        return list(self._engines)

    def add_engine(self, engine: str) -> None:
        if engine in self._engines:
            raise EngineError(f"router: engine {engine!r} is already registered")
        self._engines[engine] = EngineLoad()

    def remove_engine(self, engine: str) -> dict[str, str]:
        """Drop an engine; its sessions move to the least-loaded others. Returns key → new engine."""
        load = self._engines.pop(engine, None)
        if load is None:
            raise EngineError(f"router: unknown engine {engine!r}; known: {', '.join(self._engines)}")
        moved: dict[str, str] = {}
        for key in sorted(load.sessions):
            del self._key_to_engine[key]
            if self._engines:
                moved[key] = self._assign(key)
        return moved

    def _least_loaded(self) -> str:
        if not self._engines:
            raise EngineError("router: no engine is registered")
        return min(self._engines, key=lambda e: (self._engines[e].in_flight_tokens,
                                                  self._engines[e].in_flight_requests))

    def _assign(self, key: str) -> str:
        e = self._least_loaded()
        self._key_to_engine[key] = e
        self._engines[e].sessions.add(key)
        return e

    def route(self, key: str, prompt_tokens: int) -> str:
        """Pick the engine for a request of `prompt_tokens` and count it as in flight there."""
        if self.affinity:
            e = self._key_to_engine.get(key)
            if e is None:
                e = self._assign(key)
        else:
            e = self._least_loaded()
        load = self._engines[e]
        load.in_flight_tokens += prompt_tokens
        load.in_flight_requests += 1
        return e

    def finish(self, engine: str, prompt_tokens: int, cached_tokens: int | None = None) -> None:
        """A request finished; `cached_tokens` is how many prompt tokens hit the prefix cache."""
        load = self._engines.get(engine)
        if load is None:  # the engine was removed while the request ran
            return
        load.in_flight_tokens = max(0, load.in_flight_tokens - prompt_tokens)
        load.in_flight_requests = max(0, load.in_flight_requests - 1)
        if cached_tokens is not None:
            if not 0 <= cached_tokens <= prompt_tokens:
                raise EngineError(f"router: engine {engine!r} reported {cached_tokens} cached of "
                                  f"{prompt_tokens} prompt tokens")
            load.prompt_tokens += prompt_tokens
            load.cached_tokens += cached_tokens

    def release(self, key: str) -> None:
        """Forget a closed session's affinity."""
        e = self._key_to_engine.pop(key, None)
        if e is not None and e in self._engines:
            self._engines[e].sessions.discard(key)

    def engine_of(self, key: str) -> str | None:
        return self._key_to_engine.get(key)

    @property
    def prefix_hit_rate(self) -> float:
        p = sum(v.prompt_tokens for v in self._engines.values())
        return sum(v.cached_tokens for v in self._engines.values()) / p if p else 0.0

    def stats(self) -> dict[str, Any]:
        return {
            "prefix_hit_rate": self.prefix_hit_rate,
            "engines": {e: {"in_flight_tokens": v.in_flight_tokens, "in_flight_requests": v.in_flight_requests,
                            "sessions": len(v.sessions), "prompt_tokens": v.prompt_tokens,
                            "cached_tokens": v.cached_tokens} for e, v in self._engines.items()},
        }
