"""The rollout's engine requests: routed, batched per engine, continued after a retract,
sent again elsewhere when their engine is down.

- Batching: the requests queued for one engine in one event-loop iteration go out as
  one message. A group's n trajectories start together and reach here in the same
  iteration, so a group costs one message each way instead of n (~0.1 ms CPU per message
  in each process), and the engine admits them together (and shares their prompt).
- Retract: a request retracted by a weight update comes back with its partial output;
  `call` resubmits prompt + partial output under the new version, so the sample keeps
  every token already drawn and its per-token versions record the mix.
- Deaths: a request that fails because its engine is dead or down (ActorDeadError,
  PeerGone, EngineDown) never ran through any fault of its prompt: the engine is taken
  out of the router (`engine_down`) and the request is routed again to a live engine,
  without failing the trajectory. With no live engine it waits for one, up to
  `live_wait_s`, then fails as any engine error does.
- Engine sessions: a request of a session (an HTTP-front session's turn) carries the
  session's key, so its engine keeps the turn's KV and the next turn, routed to the same
  engine by the routing key, prefills only its new tokens. The engines that served a
  session are recorded; `end_session` (the session closed) or `release` (its routing key
  released: the group ended) sends them `EndSession`, which frees that KV.
Plain class over an `EngineLink` (the rollout actor sends the messages).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from miles.core.errors import (
    ActorDeadError,
    EngineDown,
    EngineError,
    MilesError,
    PeerGone,
)
from miles.core.generation import GenerateFailed, GenerateResult
from miles.core.images import ImageInput
from miles.core.logging import get_logger
from miles.rollout.routing.dispatch import Dispatch, NoLiveEngine
from miles.rollout.tito.client import EngineOutput

# The request never ran, or its engine is gone with it: not the prompt's fault.
DOWN_ERRORS: tuple[type[Exception], ...] = (ActorDeadError, PeerGone, EngineDown)
log = get_logger("miles.rollout.routing.requests")


@dataclass
class Request:
    input_ids: list[int]
    sampling: dict[str, Any]
    images: dict[str, Any] | None = None  # a VL request's images in wire form
    session_key: str | None = None  # the engine keeps this session's KV for its next turn


@dataclass
class EngineSession:
    """Where a session's KV may live: the engines that served its turns (more than one only
    if its engine went down, or with affinity off), under the routing key of its turns."""

    routing_key: str
    engines: set[str] = field(default_factory=set)


class EngineLink(Protocol):
    """Sends one engine the requests of one loop iteration; one reply per request, in order
    (a `GenerateFailed` is that request's own failure). `end_session` has the engine drop the
    KV it keeps for a session key."""

    async def generate(self, engine: str, batch: list[Request]) -> list[GenerateResult | GenerateFailed]: ...

    async def end_session(self, engine: str, key: str) -> None: ...


class EngineRequests:
    def __init__(self, link: EngineLink, dispatch: Dispatch, defaults: dict[str, Any], live_wait_s: float,
                 on_down: Callable[[str], None] = lambda engine: None) -> None:
        self.link, self.dispatch, self.defaults = link, dispatch, defaults
        self.live_wait_s = live_wait_s
        self.on_down = on_down  # called once per engine that goes down (to watch for its return)
        self.closing = False
        self._live = asyncio.Event()
        if dispatch.live:
            self._live.set()
        self._queued: dict[str, list[tuple[Request, asyncio.Future[GenerateResult]]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.gen_tokens = 0
        self.resubmits = 0  # requests retracted by a weight update and continued under the new version
        self.mixed_version_samples = 0
        self.sessions: dict[str, EngineSession] = {}  # session key -> engines holding its KV
        self.sessions_ended = 0  # EndSession messages an engine answered
        self.end_session_failures = 0  # ... that failed (logged; the KV stays until the engine evicts it)

    # ---------------------------------------------------------------- liveness
    def engine_down(self, engine: str, why: str) -> bool:
        if not self.dispatch.mark_down(engine, why):
            return False
        for s in self.sessions.values():  # a dead engine's session KV died with it: nothing to end there
            s.engines.discard(engine)
        if not self.dispatch.live:
            self._live.clear()
        self.on_down(engine)
        return True

    def engine_up(self, engine: str) -> bool:
        up = self.dispatch.mark_up(engine)
        self._live.set()
        return up

    # ---------------------------------------------------------------- one sample's calls
    async def call(self, key: str, prompt_ids: list[int], sampling: dict[str, Any],
                   images: ImageInput | None = None, session: str | None = None) -> EngineOutput:
        """One sample's generation, routed by `key`; `session`: the engine session key of a
        multi-turn session (its engine keeps the KV for the next turn until `end_session`)."""
        params = {**self.defaults, **sampling}
        budget = int(params["max_new_tokens"])
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        cached = 0
        wire = None if images is None else images.to_wire()
        routed_before = False
        while True:
            r = await self._once(key, Request(prompt_ids + ids, {**params, "max_new_tokens": budget - len(ids)},
                                              wire, session))
            routed_before = routed_before or r.routed_experts is not None
            cached += r.cached_tokens
            ids += r.output_ids
            logprobs += r.logprobs
            versions += r.versions
            finish = r.finish_reason
            if not r.retracted:
                break
            if len(ids) >= budget:
                finish = "length"  # retracted exactly at the budget: nothing left to sample
                if r.routed_experts is None and routed_before:
                    # SGLang answers an aborted request without its routing, and no continuation
                    # follows to bring it: the sample cannot be replayed (R3), so it fails, counted.
                    raise EngineError(f"request retracted at its token budget ({budget}) by a weight update "
                                      "came back without its routed experts; the sample cannot be replayed")
                break
            # The routed experts of the continuation cover the whole sequence, so only its are kept.
            self.resubmits += 1
        # [T, L, k] from the embedded engine; [T - 1, L, k] from engines that never feed the last
        # sampled token (SGLang). The trainer accepts both: no loss position needs that row.
        if len(set(versions)) > 1:
            self.mixed_version_samples += 1
        self.gen_tokens += len(ids)
        return EngineOutput(ids, logprobs, finish, versions, r.routed_experts, cached)

    async def _once(self, key: str, req: Request) -> GenerateResult:
        n = len(req.input_ids)
        while True:
            engine = await self._route(key, n)
            try:
                r = await self._queue(engine, req)
            except DOWN_ERRORS as exc:
                if self.closing:
                    raise
                self.engine_down(engine, f"{type(exc).__name__}: {exc}")
                self.dispatch.lost(engine, n)
                continue  # nothing of it was kept: the whole request runs again elsewhere
            except EngineError:
                self.dispatch.finish(engine, n)  # refused by the engine: it kept nothing of the session
                raise
            except BaseException:
                self._add_session(req, key, engine)  # e.g. a timeout: the engine may hold the turn's KV
                self.dispatch.finish(engine, n)
                raise
            self._add_session(req, key, engine)
            self.dispatch.finish(engine, n, r.cached_tokens)
            return r

    async def _route(self, key: str, n: int) -> str:
        deadline = time.monotonic() + self.live_wait_s
        while True:
            try:
                return self.dispatch.route(key, n)
            except NoLiveEngine as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError(f"no live engine for {self.live_wait_s:g}s: {exc}") from exc
                try:
                    await asyncio.wait_for(self._live.wait(), left)
                except TimeoutError:
                    pass

    # ---------------------------------------------------------------- session ends
    def _add_session(self, req: Request, key: str, engine: str) -> None:
        session = req.session_key
        if session is None:
            return
        self.sessions.setdefault(session, EngineSession(key)).engines.add(engine)

    async def end_session(self, session: str) -> None:
        """`session` closed: its engines drop its KV. A failure is logged and counted, never
        raised: that KV is only a cache, which the engine's LRU budget evicts in time."""
        s = self.sessions.pop(session, None)
        if s is None:
            return
        for engine in sorted(s.engines):
            if engine in self.dispatch.down:
                continue  # gone with the engine (a restarted one never saw the key)
            try:
                await self.link.end_session(engine, session)
                self.sessions_ended += 1
            except MilesError as exc:
                self.end_session_failures += 1
                log.warning("end_session_failed", engine=engine, session=session,
                            error=f"{type(exc).__name__}: {exc}")

    async def release(self, key: str) -> None:
        """The routing key `key` is released (its group ended, or its last session closed): the
        dispatch forgets it and every session still open under it ends on its engines."""
        self.dispatch.release(key)
        for session in sorted(k for k, s in self.sessions.items() if s.routing_key == key):
            await self.end_session(session)

    # ---------------------------------------------------------------- batching
    def _queue(self, engine: str, req: Request) -> asyncio.Future[GenerateResult]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[GenerateResult] = loop.create_future()
        queued = self._queued.get(engine)
        if queued is None:
            queued = self._queued[engine] = []
            loop.call_soon(self._send, engine)
        queued.append((req, fut))
        return fut

    def _send(self, engine: str) -> None:
        batch = [q for q in self._queued.pop(engine, []) if not q[1].done()]  # done: its caller is gone
        if batch:
            t = asyncio.create_task(self._ask(engine, batch), name=f"generate-{engine}")
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _ask(self, engine: str, batch: list[tuple[Request, asyncio.Future[GenerateResult]]]) -> None:
        try:
            replies = await self.link.generate(engine, [q[0] for q in batch])
            if len(replies) != len(batch):
                raise EngineError(f"{engine}: {len(replies)} replies to {len(batch)} requests")
        except BaseException as exc:
            for _, fut in batch:  # every request of the message fails as its own ask would
                if not fut.done():
                    if isinstance(exc, Exception):
                        fut.set_exception(exc)
                    else:
                        fut.cancel()
            if not isinstance(exc, Exception):
                raise
            return
        for (_, fut), r in zip(batch, replies, strict=True):
            if not fut.done():
                if isinstance(r, GenerateFailed):
                    fut.set_exception(r.exception())
                else:
                    fut.set_result(r)

    async def close(self) -> None:
        self.closing = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
