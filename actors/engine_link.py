"""The rollout's `EngineLink` over the actor runtime: one engine's batch of one event-loop
iteration goes out as one `Generate` (a single request) or one `GenerateMany`; a session's
end goes out as `EndSession`.

The rollout actor sends its engine requests through it; the session benches and tests
build the same request path (EngineRequests + Dispatch) over it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from miles.actors.messages import EndSession, Generate, GenerateMany
from miles.actors.runtime.ref import ActorRef
from miles.rollout.routing.requests import Request


class ActorEngineLink:
    """`ref(name)` reaches an engine actor; every ask waits at most `timeout_s`."""

    def __init__(self, ref: Callable[[str], ActorRef], timeout_s: float, routing_replay: bool = False) -> None:
        self.ref, self.timeout, self.routing_replay = ref, timeout_s, routing_replay

    async def generate(self, engine: str, batch: list[Request]) -> list[dict[str, Any]]:
        rr = self.routing_replay
        if len(batch) == 1:
            q = batch[0]
            return [await self.ref(engine).ask(Generate(q.input_ids, q.sampling, q.session_key, rr, images=q.images),
                                               timeout=self.timeout)]
        imgs = [q.images for q in batch] if any(q.images is not None for q in batch) else []
        keys = [q.session_key for q in batch] if any(q.session_key is not None for q in batch) else []
        replies: list[dict[str, Any]] = await self.ref(engine).ask(
            GenerateMany([q.input_ids for q in batch], [q.sampling for q in batch], rr, imgs, keys),
            timeout=self.timeout)
        return replies

    async def end_session(self, engine: str, key: str) -> None:
        await self.ref(engine).ask(EndSession(key), timeout=self.timeout)
