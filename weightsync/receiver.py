"""Engine side of the weight sync: buckets and byte ranges in, staged versions committed.

A plain class the engine actor (actors/engine.py) forwards its sync messages to
(weightsync/messages.py), so the actor holds no sync logic. Buckets arrive inline (zmq,
`stage`) or through a bulk receiver (`open` / `recv` / `close`, transport/bulk/), and a
flat plan's byte ranges land straight in the engine's staging slots (`plan` / `flat_range`,
weightsync/flat.py). Each bucket is copied once into the engine's staging area, behind the
next bucket's transfer; a torch engine's stager is bound to its model, so commit swaps
parameter storages instead of copying them again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch

from miles.core.errors import EngineError, PlanMissing, SyncError
from miles.core.logging import get_logger
from miles.models.hf_io import hf_param_views, hf_tensor_views
from miles.transport.bulk.base import BulkReceiver, LocalWeights, make_receiver
from miles.transport.bulk.buckets import Reassembler
from miles.weightsync.flat import NO_SLOTS, FlatDeclined, FlatLanding, FlatPlan
from miles.weightsync.stager import Staging

log = get_logger("miles.engine_actor")


class Served(Protocol):
    """What the receiver reads of an engine's health reply (engines/base.py `HealthReply`)."""

    @property
    def version(self) -> int: ...


class ReceivingEngine(Protocol):
    """What the receiver needs of an engine (engines/base.py `Engine` has it all)."""

    def staging(self) -> Staging | None: ...

    async def stage(
        self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> int: ...

    async def commit(self, version: int) -> None: ...

    async def abort_version(self, version: int) -> None: ...

    def health(self) -> Served: ...  # engines/base.py HealthReply

    def state_dict_hf(self) -> dict[str, torch.Tensor]: ...


class WeightReceiver:
    """One engine's landing of weight versions. `name` is the engine's, for errors."""

    def __init__(self, engine: ReceivingEngine, name: str) -> None:
        self.engine, self.name = engine, name
        self._reassembler = Reassembler()
        self._receiver: BulkReceiver | None = None
        self._live: dict[str, torch.Tensor] | None = None
        self._pending: asyncio.Future[int] | None = None  # the bucket being staged in the background
        self._landing: FlatLanding | None = None  # the flat plan byte ranges land by
        self._staging = engine.staging()
        if self._staging is not None and self._staging.model is not None:
            model = self._staging.model
            self._staging.stager.bind_model(model, lambda n, t: hf_param_views(model.spec, n, t))

    async def stage(self, version: int, names: list[str], tensors: list[torch.Tensor]) -> int:
        """One inline bucket of `version`; returns the tensors staged so far."""
        if len(names) != len(tensors):
            raise EngineError(f"stage v{version}: {len(names)} names for {len(tensors)} tensors")
        whole = []
        for name, t in zip(names, tensors, strict=True):
            done = self._reassembler.add(name, t)  # tensors larger than a bucket arrive in chunks
            if done is not None:
                whole.append(done)
        return await self._stage_behind(version, whole)

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

    async def commit(self, version: int) -> None:
        try:
            await self._settle()
            # The swap is host-side and the receiver's copies run on the stream generation uses,
            # so the engine commits while the last copies finish; they are waited for before
            # the reply (after which the trainer may reuse what they read) and before unmapping.
            await self.engine.commit(version)
        finally:
            self._live = None  # a swapping commit moves the live tensors
            await self._release_receiver()

    async def abort_version(self, version: int) -> None:
        self._reassembler = Reassembler()
        try:
            await self._settle()
        except Exception as exc:  # noqa: BLE001 - the version is being dropped anyway
            log.info("abort_version_staging_failed", version=version, error=str(exc))
        await self._release_receiver()
        await self.engine.abort_version(version)

    async def _release_receiver(self) -> None:
        if self._receiver is not None:
            await self._receiver.settle()
            self._receiver.release()

    async def close(self) -> None:
        """Close the open bulk receiver, if any."""
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
        return LocalWeights(self.engine.health().version, get, slot)

    async def open(self, transport: str, info: dict[str, Any], bucket_bytes: int) -> None:
        """Connect a receiver of channel `transport` (replaces any open one)."""
        await self.close()
        rx = make_receiver(transport, info, bucket_bytes)
        await rx.open()
        self._receiver = rx

    async def recv(self, version: int, header: dict[str, Any]) -> int:
        """Receive bucket `header` of `version` on the open channel and stage it."""
        if self._receiver is None:
            raise SyncError(f"engine {self.name!r}: bucket of v{version} arrived before BulkOpen")
        await self._settle()  # the receiver may reuse the buffer the last bucket is staged from
        whole = []
        for name, t in await self._receiver.recv(header, self._local()):
            done = self._reassembler.add(name, t)
            if done is not None:
                whole.append(done)
        return await self._stage_behind(version, whole)

    async def plan(self, plan: dict[str, Any]) -> bool | str:
        """Take a flat plan: checked against the staging slots now, so a mismatch is refused
        before any range moves. True: taken; else the reason it is declined (the coordinator
        then sends tensors, and warns with this reason)."""
        if self._staging is None:
            return f"engine {self.name!r} ({type(self.engine).__name__}) {NO_SLOTS}"
        landing = FlatLanding(FlatPlan.from_wire(plan))
        await self._settle()
        # slots for what the engine takes beside its weights (a LoRA adapter payload); the ranges
        # of the version before have landed (every range is answered before its commit)
        self._staging.stager.set_aside(landing.plan)
        try:
            landing.region(self._local())
        except FlatDeclined as exc:  # any other mismatch (a tensor or shape the engine lacks) fails the push
            log.warning("flat_plan_declined", reason=str(exc))
            return f"engine {self.name!r}: {exc}"
        self._landing = landing
        return True

    async def flat_range(self, version: int, digest: str, lo: int, hi: int, header: dict[str, Any],
                         data: torch.Tensor | None) -> int:
        """Bytes [lo, hi) of plan `digest`: inline in `data` (zmq), else on the open channel."""
        landing = self._landing
        if landing is None or landing.plan.digest != digest:
            raise PlanMissing(f"engine {self.name!r}: flat range of v{version} for plan {digest} arrived, "
                              f"this engine holds plan {landing.plan.digest if landing else None}")
        await self._settle()
        local = self._local()
        if data is not None:  # inline (zmq)
            names = landing.land(lo, hi, data.reshape(-1).view(torch.uint8), local)
        elif self._receiver is None:
            raise SyncError(f"engine {self.name!r}: flat range of v{version} arrived before BulkOpen")
        else:
            names = await self._receiver.recv_flat(header, landing, local)
        assert self._staging is not None  # a plan was taken (plan), so the engine stages
        return self._staging.mark_staged(version, names)
