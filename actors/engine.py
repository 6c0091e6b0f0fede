"""Engine actor: serves the engine contract (engines/base.py) over the wire.

A thin shell: messages in, calls into an `Engine` out. Weight buckets arrive as
zero-copy tensor frames (or through a bulk receiver) and are copied once into the
engine's staging area; a torch engine's stager is bound to its model so that commit
swaps parameter storages instead of copying them again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

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
from miles.core.errors import EngineError, PlanMissing, SyncError
from miles.core.images import ImageInput
from miles.core.logging import get_logger
from miles.engines.base import Engine, GenerateRequest, GenerateResult, SamplingParams
from miles.models.hf_io import hf_param_views, hf_tensor_views
from miles.transport.bulk.base import BulkReceiver, LocalWeights, make_receiver
from miles.transport.bulk.buckets import Reassembler
from miles.weightsync.flat import FlatDeclined, FlatLanding, FlatPlan
from miles.weightsync.messages import BulkClose, BulkOpen, BulkPlan, BulkRecv, FlatRange, Stage

log = get_logger("miles.engine_actor")


def result_to_wire(r: GenerateResult) -> dict[str, Any]:
    return {
        "request_id": r.request_id, "output_ids": r.output_ids, "logprobs": r.logprobs,
        "finish_reason": r.finish_reason, "versions": r.versions, "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens, "retracted": r.retracted, "routed_experts": r.routed_experts,
    }


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
        self._reassembler = Reassembler()
        self._receiver: BulkReceiver | None = None
        self._live: dict[str, torch.Tensor] | None = None
        self._pending: asyncio.Future[int] | None = None  # the bucket being staged in the background
        self._landing: FlatLanding | None = None  # the flat plan byte ranges land by
        self._staging = engine.staging()
        if self._staging is not None and self._staging.model is not None:
            model = self._staging.model
            self._staging.stager.bind_model(model, lambda n, t: hf_param_views(model.spec, n, t))

    async def on_stop(self) -> None:
        await self._close_receiver()
        await self.engine.close()

    @handler(Generate, concurrency=1024)
    async def generate(self, msg: Generate) -> dict[str, Any]:
        req = GenerateRequest(msg.input_ids, sampling_from_wire(msg.sampling), msg.session_key,
                              msg.return_routed_experts, images=images_from_wire(msg.images))
        if msg.request_id:
            req.request_id = msg.request_id
        return result_to_wire(await self.engine.generate(req))

    @handler(GenerateMany, concurrency=1024)
    async def generate_many(self, msg: GenerateMany) -> list[dict[str, Any]]:
        if len(msg.input_ids) != len(msg.sampling):
            raise EngineError(f"GenerateMany: {len(msg.input_ids)} prompts for {len(msg.sampling)} samplings")
        n = len(msg.input_ids)
        images = msg.images or [None] * n
        keys = msg.session_keys or [None] * n
        if len(images) != n or len(keys) != n:
            raise EngineError(f"GenerateMany: {n} prompts for {len(images)} image sets and {len(keys)} session keys")

        async def one(ids: list[int], sampling: dict[str, Any], imgs: dict[str, Any] | None,
                      key: str | None) -> dict[str, Any]:
            req = GenerateRequest(ids, sampling_from_wire(sampling), key, msg.return_routed_experts,
                                  images=images_from_wire(imgs))
            return result_to_wire(await self.engine.generate(req))

        # Submitted together, so the engine admits them in one step (and shares their prompt).
        done = await asyncio.gather(*(one(i, s, m, k) for i, s, m, k in zip(msg.input_ids, msg.sampling, images,
                                                                            keys, strict=True)),
                                    return_exceptions=True)
        out: list[dict[str, Any]] = []
        for r in done:
            if isinstance(r, BaseException):
                if not isinstance(r, Exception):
                    raise r  # cancellation of the whole message
                out.append({"error_type": type(r).__name__, "error": str(r)})
            else:
                out.append(r)
        return out

    @handler(Pause)
    async def pause(self, msg: Pause) -> int:
        if msg.mode not in ("auto", "abort", "retract", "in_place"):
            raise EngineError(f"pause mode {msg.mode!r}: valid are auto, abort, retract, in_place")
        mode = self.engine.default_pause_mode if msg.mode == "auto" else msg.mode  # auto: the engine's own
        return len(await self.engine.pause(mode))  # type: ignore[arg-type]

    @handler(Resume)
    async def resume(self, msg: Resume) -> None:
        await self.engine.resume()

    @handler(AbortRequest, concurrency=16)
    async def abort(self, msg: AbortRequest) -> bool:
        return await self.engine.abort(msg.request_id)

    @handler(Stage)
    async def stage(self, msg: Stage) -> int:
        if len(msg.names) != len(msg.tensors):
            raise EngineError(f"stage v{msg.version}: {len(msg.names)} names for {len(msg.tensors)} tensors")
        whole = []
        for name, t in zip(msg.names, msg.tensors, strict=True):
            done = self._reassembler.add(name, t)  # tensors larger than a bucket arrive in chunks
            if done is not None:
                whole.append(done)
        return await self._stage_behind(msg.version, whole)

    async def _stage_behind(self, version: int, whole: list[tuple[str, torch.Tensor]]) -> int:
        """Start staging one bucket and answer at once, so its copy overlaps the next bucket's
        transfer. One bucket is in flight at most; its failure surfaces at the next bucket or
        at commit (both abort the version). The tensors must stay valid until `_settle`."""
        staged = await self._settle()
        self._pending = asyncio.ensure_future(self.engine.stage(version, whole))
        return staged + len(whole)

    async def _settle(self) -> int:
        """Wait for the bucket still being staged; re-raises its error."""
        task, self._pending = self._pending, None
        return 0 if task is None else await task

    @handler(Commit)
    async def commit(self, msg: Commit) -> None:
        try:
            await self._settle()
            # The swap is host-side and the receiver's copies run on the stream generation uses,
            # so the engine commits while the last copies finish; they are waited for before
            # the reply (after which the trainer may reuse what they read) and before unmapping.
            await self.engine.commit(msg.version)
        finally:
            self._live = None  # a swapping commit moves the live tensors
            await self._release_receiver()

    @handler(AbortVersion)
    async def abort_version(self, msg: AbortVersion) -> None:
        self._reassembler = Reassembler()
        try:
            await self._settle()
        except Exception as exc:  # noqa: BLE001 - the version is being dropped anyway
            log.info("abort_version_staging_failed", version=msg.version, error=str(exc))
        await self._release_receiver()
        await self.engine.abort_version(msg.version)

    async def _release_receiver(self) -> None:
        if self._receiver is not None:
            await self._receiver.settle()
            self._receiver.release()

    @handler(EndSession, concurrency=16)
    async def end_session(self, msg: EndSession) -> None:
        await self.engine.end_session(msg.key)

    @handler(Health, concurrency=4)
    def health(self, msg: Health) -> dict[str, Any]:
        return self.engine.health()

    @handler(Stats, concurrency=4)
    def stats(self, msg: Stats) -> dict[str, Any]:
        return self.engine.stats()

    @handler(Checksums)
    async def checksums(self, msg: Checksums) -> dict[str, str]:
        # Hashing every weight takes seconds on a large model: a worker thread does it, so the
        # loop keeps serving heartbeats and requests meanwhile.
        return await asyncio.to_thread(self.engine.checksums)

    # ---- receiver side of the bulk weight channels (transport/bulk) -------------------
    async def _close_receiver(self) -> None:
        rx, self._receiver = self._receiver, None
        if rx is not None:
            await rx.close()

    def _local(self) -> LocalWeights:
        def get(name: str) -> torch.Tensor:
            # Built on first use only (delta channels read the live weights; the others never
            # do): listing every HF view costs per tensor, every version.
            if self._live is None:
                model = self._staging.model if self._staging is not None else None
                # Live views (updated in place by commit); engines without a miles model give copies.
                self._live = hf_tensor_views(model) if model is not None else self.engine.state_dict_hf()
            t = self._live.get(name)
            if t is None:
                raise SyncError(f"engine {self.name!r} holds no tensor {name!r}")
            return t

        slot = self._staging.stager.slot if self._staging is not None else None
        return LocalWeights(int(self.engine.health()["version"]), get, slot)

    @handler(BulkOpen)
    async def bulk_open(self, msg: BulkOpen) -> None:
        await self._close_receiver()
        rx = make_receiver(msg.transport, msg.info, msg.bucket_bytes)
        await rx.open()
        self._receiver = rx

    @handler(BulkRecv)
    async def bulk_recv(self, msg: BulkRecv) -> int:
        if self._receiver is None:
            raise SyncError(f"engine {self.name!r}: bucket of v{msg.version} arrived before BulkOpen")
        await self._settle()  # the receiver may reuse the buffer the last bucket is staged from
        whole = []
        for name, t in await self._receiver.recv(msg.header, self._local()):
            done = self._reassembler.add(name, t)
            if done is not None:
                whole.append(done)
        return await self._stage_behind(msg.version, whole)

    @handler(BulkPlan)
    async def bulk_plan(self, msg: BulkPlan) -> bool | str:
        """Take a flat plan: checked against the staging slots now, so a mismatch is refused
        before any range moves. True: taken; else the reason it is declined (the coordinator
        then sends tensors, and warns with this reason)."""
        if self._staging is None:
            return f"engine {self.name!r} ({type(self.engine).__name__}) has no staging slots to land byte ranges in"
        landing = FlatLanding(FlatPlan.from_wire(msg.plan))
        await self._settle()
        try:
            landing.region(self._local())
        except FlatDeclined as exc:
            log.warning("flat_plan_declined", reason=str(exc))
            return f"engine {self.name!r}: {exc}"
        self._landing = landing
        return True

    @handler(FlatRange)
    async def flat_range(self, msg: FlatRange) -> int:
        landing = self._landing
        if landing is None or landing.plan.digest != msg.digest:
            raise PlanMissing(f"engine {self.name!r}: flat range of v{msg.version} for plan {msg.digest} arrived, "
                              f"this engine holds plan {landing.plan.digest if landing else None}")
        await self._settle()
        local = self._local()
        if msg.data is not None:  # inline (zmq)
            names = landing.land(msg.lo, msg.hi, msg.data.reshape(-1).view(torch.uint8), local)
        elif self._receiver is None:
            raise SyncError(f"engine {self.name!r}: flat range of v{msg.version} arrived before BulkOpen")
        else:
            names = await self._receiver.recv_flat(msg.header, landing, local)
        assert self._staging is not None  # a plan was taken (bulk_plan), so the engine stages
        return self._staging.mark_staged(msg.version, names)

    @handler(BulkClose)
    async def bulk_close(self, msg: BulkClose) -> None:
        await self._close_receiver()
