"""The rollout's `EngineLink` over the actor runtime: one engine's batch of one event-loop
iteration goes out as one `Generate` (a single request) or one `GenerateMany`; a session's
end goes out as `EndSession`.

The rollout actor sends its engine requests through it; the session benches and tests
build the same request path (EngineRequests + Dispatch) over it.
"""

from __future__ import annotations

from collections.abc import Callable

from miles.actors.messages import EndSession, Generate, GenerateMany
from miles.actors.runtime.ref import ActorRef
from miles.core.errors import ProtocolError
from miles.core.generation import GenerateFailed, GenerateResult
from miles.rollout.routing.requests import Request


class ActorEngineLink:
    """`ref(name)` reaches an engine actor; every ask waits at most `timeout_s`."""

    def __init__(self, ref: Callable[[str], ActorRef], timeout_s: float, routing_replay: bool = False) -> None:
        self.ref, self.timeout, self.routing_replay = ref, timeout_s, routing_replay

    async def generate(self, engine: str, batch: list[Request]) -> list[GenerateResult | GenerateFailed]:
        rr = self.routing_replay
        if len(batch) == 1:
            q = batch[0]
            one = await self.ref(engine).ask(Generate(q.input_ids, q.sampling, q.session_key, rr, images=q.images),
                                             timeout=self.timeout)
            return [_reply(engine, one, "Generate")]
        imgs = [q.images for q in batch] if any(q.images is not None for q in batch) else []
        keys = [q.session_key for q in batch] if any(q.session_key is not None for q in batch) else []
        replies = await self.ref(engine).ask(
            GenerateMany([q.input_ids for q in batch], [q.sampling for q in batch], rr, imgs, keys),
            timeout=self.timeout)
        if not isinstance(replies, list):
            raise ProtocolError(f"{engine}: GenerateMany answered {type(replies).__name__}, not a list of replies")
        return [_reply(engine, r, f"GenerateMany[{i}]") for i, r in enumerate(replies)]

    async def end_session(self, engine: str, key: str) -> None:
        await self.ref(engine).ask(EndSession(key), timeout=self.timeout)


def _reply(engine: str, r: object, what: str) -> GenerateResult | GenerateFailed:
    """The decoder checked each record's fields; this checks that a record came at all (a peer
    speaking an older wire answers with a map)."""
    if isinstance(r, GenerateResult | GenerateFailed):
        return r
    raise ProtocolError(f"{engine}: {what} answered {type(r).__name__}, not an engine.GenerateResult record")
