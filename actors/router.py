"""Router actor: forwards `Generate` to one engine actor chosen by `RouterPolicy`.

A request's `session_key` is its affinity key: every turn of a session goes to
the engine that holds the session's KV (the key is passed on, so the engine
keeps and reuses that KV); a new key goes to the engine with the fewest
in-flight tokens. Each engine reply's `cached_tokens` feeds the prefix-cache hit
rate. An engine that dies (declared dead by the directory, or found dead by an
ask) is removed, its sessions move to the others and the request is retried
there; `EndSession` frees the session's KV on every engine that served it.
"""

from __future__ import annotations

from typing import Any

from miles.actors.messages import EndSession, Generate
from miles.actors.runtime.actor import Actor, handler
from miles.actors.runtime.messages import DeathNotice
from miles.actors.session_messages import AddEngine, RemoveEngine, RouterStats
from miles.core.clock import new_id
from miles.core.errors import ActorDeadError, EngineError, MilesError, PeerGone
from miles.core.logging import get_logger
from miles.rollout.routing import RouterPolicy

log = get_logger("miles.router")


class RouterActor(Actor):
    def __init__(self, engines: list[str], affinity: bool = True, engine_timeout_s: float = 300.0) -> None:
        if engine_timeout_s <= 0:
            raise EngineError(f"router: engine_timeout_s must be > 0, got {engine_timeout_s}")
        self.policy = RouterPolicy(engines, affinity)
        self.engine_timeout_s = engine_timeout_s
        self._holders: dict[str, set[str]] = {}  # session key -> engines that may hold its KV
        self.requests = 0
        self.retries = 0
        self.removed: list[str] = []

    async def on_start(self) -> None:
        self.host.on_death(self._on_death)

    def _on_death(self, notice: DeathNotice) -> None:
        for name in notice.names:
            if name in self.policy.engines:
                self._drop(name, f"declared dead: {notice.reason}")

    def _drop(self, engine: str, why: str) -> None:
        if engine not in self.policy.engines:
            return
        moved = self.policy.remove_engine(engine)
        for holders in self._holders.values():
            holders.discard(engine)
        self.removed.append(engine)
        log.warning("engine_removed", engine=engine, why=why, sessions_moved=len(moved),
                    engines_left=len(self.policy.engines))

    @handler(Generate, concurrency=4096)
    async def generate(self, msg: Generate) -> dict[str, Any]:
        self.requests += 1
        # A keyless request still needs a routing key for the load bookkeeping; it is released after.
        key = msg.session_key or "once-" + (msg.request_id or new_id("r"))
        try:
            return await self._forward(msg, key)
        finally:
            if not msg.session_key:
                self.policy.release(key)

    async def _forward(self, msg: Generate, key: str) -> dict[str, Any]:
        n = len(msg.input_ids)
        while True:
            engine = self.policy.route(key, n)
            try:
                r: dict[str, Any] = await self.ref(engine).ask(
                    Generate(msg.input_ids, msg.sampling, msg.session_key, msg.return_routed_experts,
                             msg.request_id, msg.images),
                    timeout=self.engine_timeout_s)
            except (ActorDeadError, PeerGone) as exc:
                self.policy.finish(engine, n)
                self._drop(engine, f"{type(exc).__name__}: {exc}")
                if not self.policy.engines:
                    raise EngineError(f"router: every engine is gone (last: {engine!r}: {exc})") from exc
                self.retries += 1
                continue  # nothing was committed: the request runs again on the session's new engine
            except BaseException:
                self.policy.finish(engine, n)
                raise
            self.policy.finish(engine, n, min(int(r["cached_tokens"]), n))
            if msg.session_key:
                self._holders.setdefault(msg.session_key, set()).add(engine)
            r["engine"] = engine
            return r

    @handler(EndSession, concurrency=64)
    async def end_session(self, msg: EndSession) -> int:
        """Free the session's KV on every engine that served it; returns how many were told."""
        holders = self._holders.pop(msg.key, set())
        self.policy.release(msg.key)
        told = 0
        for engine in sorted(holders):
            if engine not in self.policy.engines:
                continue
            try:
                await self.ref(engine).ask(EndSession(msg.key), timeout=self.engine_timeout_s)
                told += 1
            except MilesError as exc:  # the KV is only a cache: losing the release is harmless
                log.warning("end_session_failed", engine=engine, key=msg.key, error=f"{type(exc).__name__}: {exc}")
        return told

    @handler(AddEngine)
    def add_engine(self, msg: AddEngine) -> list[str]:
        self.policy.add_engine(msg.name)
        return self.policy.engines

    @handler(RemoveEngine)
    def remove_engine(self, msg: RemoveEngine) -> list[str]:
        if msg.name not in self.policy.engines:
            raise EngineError(f"router: unknown engine {msg.name!r}; known: {', '.join(self.policy.engines)}")
        self._drop(msg.name, "removed on request")
        return self.policy.engines

    @handler(RouterStats, concurrency=4)
    def stats(self, msg: RouterStats) -> dict[str, Any]:
        return {**self.policy.stats(), "affinity": self.policy.affinity, "requests": self.requests,
                "retries": self.retries, "removed": list(self.removed),
                "sessions": {k: sorted(v) for k, v in self._holders.items()}}
