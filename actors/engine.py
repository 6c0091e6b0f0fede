"""Engine actor: serves the engine contract (engines/base.py) over the wire.

A thin shell: messages in, calls into an `Engine` out. The weight-sync messages go to the
engine's `WeightReceiver` (weightsync/receiver.py), which lands buckets and byte ranges in
the engine's staging area and commits versions.
"""

from __future__ import annotations

import asyncio
from typing import Any

from miles.actors.messages import (
    AbortRequest,
    AbortVersion,
    Checksums,
    Commit,
    EndSession,
    Generate,
    GenerateMany,
    Health,
    Pause,
    Resume,
    Stats,
)
from miles.actors.runtime.actor import Actor, handler
from miles.core.errors import EngineError
from miles.core.generation import GenerateFailed
from miles.core.images import ImageInput
from miles.core.schema.sync import pause_mode_for
from miles.engines.base import Engine, GenerateRequest, GenerateResult, HealthReply, SamplingParams
from miles.weightsync.messages import BulkClose, BulkOpen, BulkPlan, BulkRecv, FlatRange, Stage
from miles.weightsync.receiver import WeightReceiver

_SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "seed"}


def sampling_from_wire(d: dict[str, Any]) -> SamplingParams:
    unknown = set(d) - _SAMPLING_KEYS
    if unknown:
        raise EngineError(f"unknown sampling parameter(s) {sorted(unknown)}; valid: {sorted(_SAMPLING_KEYS)}")
    return SamplingParams(**d)


def images_from_wire(d: dict[str, Any] | None) -> ImageInput | None:
    return None if d is None else ImageInput.from_wire(d, "Generate.images")


class EngineActor(Actor):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.weights = WeightReceiver(engine, "")  # named at start (the runtime names the actor)

    async def on_start(self) -> None:
        self.weights.name = self.name

    async def on_stop(self) -> None:
        await self.weights.close()
        await self.engine.close()

    @handler(Generate, concurrency=1024)
    async def generate(self, msg: Generate) -> GenerateResult:
        req = GenerateRequest(msg.input_ids, sampling_from_wire(msg.sampling), msg.session_key,
                              msg.return_routed_experts, images=images_from_wire(msg.images))
        if msg.request_id:
            req.request_id = msg.request_id
        return await self.engine.generate(req)

    @handler(GenerateMany, concurrency=1024)
    async def generate_many(self, msg: GenerateMany) -> list[GenerateResult | GenerateFailed]:
        if len(msg.input_ids) != len(msg.sampling):
            raise EngineError(f"GenerateMany: {len(msg.input_ids)} prompts for {len(msg.sampling)} samplings")
        n = len(msg.input_ids)
        images = msg.images or [None] * n
        keys = msg.session_keys or [None] * n
        if len(images) != n or len(keys) != n:
            raise EngineError(f"GenerateMany: {n} prompts for {len(images)} image sets and {len(keys)} session keys")

        async def one(ids: list[int], sampling: dict[str, Any], imgs: dict[str, Any] | None,
                      key: str | None) -> GenerateResult:
            req = GenerateRequest(ids, sampling_from_wire(sampling), key, msg.return_routed_experts,
                                  images=images_from_wire(imgs))
            return await self.engine.generate(req)

        # Submitted together, so the engine admits them in one step (and shares their prompt).
        done = await asyncio.gather(*(one(i, s, m, k) for i, s, m, k in zip(msg.input_ids, msg.sampling, images,
                                                                            keys, strict=True)),
                                    return_exceptions=True)
        out: list[GenerateResult | GenerateFailed] = []
        for r in done:
            if isinstance(r, BaseException):
                if not isinstance(r, Exception):
                    raise r  # cancellation of the whole message
                out.append(GenerateFailed.of(r))
            else:
                out.append(r)
        return out

    @handler(Pause)
    async def pause(self, msg: Pause) -> int:
        return len(await self.engine.pause(pause_mode_for(msg.mode, self.engine.default_pause_mode)))

    @handler(Resume)
    async def resume(self, msg: Resume) -> None:
        await self.engine.resume()

    @handler(AbortRequest, concurrency=16)
    async def abort(self, msg: AbortRequest) -> bool:
        return await self.engine.abort(msg.request_id)

    # ---- weight sync: forwarded to the receiver (weightsync/receiver.py) -----------------
    @handler(Stage)
    async def stage(self, msg: Stage) -> int:
        return await self.weights.stage(msg.version, msg.names, msg.tensors)

    @handler(Commit)
    async def commit(self, msg: Commit) -> None:
        await self.weights.commit(msg.version)

    @handler(AbortVersion)
    async def abort_version(self, msg: AbortVersion) -> None:
        await self.weights.abort_version(msg.version)

    @handler(BulkOpen)
    async def bulk_open(self, msg: BulkOpen) -> None:
        await self.weights.open(msg.transport, msg.info, msg.bucket_bytes)

    @handler(BulkRecv)
    async def bulk_recv(self, msg: BulkRecv) -> int:
        return await self.weights.recv(msg.version, msg.header)

    @handler(BulkPlan)
    async def bulk_plan(self, msg: BulkPlan) -> bool | str:
        return await self.weights.plan(msg.plan)

    @handler(FlatRange)
    async def flat_range(self, msg: FlatRange) -> int:
        return await self.weights.flat_range(msg.version, msg.digest, msg.lo, msg.hi, msg.header, msg.data)

    @handler(BulkClose)
    async def bulk_close(self, msg: BulkClose) -> None:
        await self.weights.close()

    @handler(EndSession, concurrency=16)
    async def end_session(self, msg: EndSession) -> None:
        await self.engine.end_session(msg.key)

    @handler(Health, concurrency=4)
    def health(self, msg: Health) -> HealthReply:
        return self.engine.health()

    @handler(Stats, concurrency=4)
    def stats(self, msg: Stats) -> dict[str, Any]:
        return self.engine.stats()

    @handler(Checksums)
    async def checksums(self, msg: Checksums) -> dict[str, str]:
        # Hashing every weight takes seconds on a large model: a worker thread does it, so the
        # loop keeps serving heartbeats and requests meanwhile.
        return await asyncio.to_thread(self.engine.checksums)
