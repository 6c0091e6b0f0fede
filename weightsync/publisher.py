"""Trainer side of the weight hand-off: export -> push -> catch-up, each phase timed.

Every trainer rank exports (the gather is a collective over FSDP shards); rank 0 also
pushes the version to the engines and keeps what a restarted engine is caught up from.
Nothing on the push's critical path is there for catch-ups alone:

- `catchup_source = export_buffer` (the default for flat exports): the flat export buffer
  itself holds the last pushed version until the next export refills it, so a catch-up
  sends from it under the same lock the export takes. No copy, no extra memory.
- `host_copy`: after the push, a worker thread copies the buffer into (pinned) host memory
  on a side CUDA stream, overlapping the next rollout wait and train step; the next export
  waits for it (it refills the buffer). A tensor-by-tensor export (LoRA adapters,
  disk_delta) is consumed by its push, so its copy is taken as it streams.

The export runs in a worker thread, so heartbeats and other handlers keep running on the
event loop while the weights are gathered and cast.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any, Protocol

import torch

from miles.core.errors import MilesError
from miles.core.logging import get_logger
from miles.core.schema.sync import SyncConfig
from miles.models.config import ModelSpec
from miles.models.fp8_layout import fp8_block
from miles.models.fp8_model import fp8_export
from miles.weightsync.flat import FlatWeights
from miles.weightsync.push_round import SyncReport

log = get_logger("miles.trainer")

Named = Iterable[tuple[str, torch.Tensor]]


class Pusher(Protocol):
    """Rank 0's way to the engines (weightsync/actor_wire.py `WeightSync`: the coordinator over actor asks)."""

    async def push(self, version: int, named: Any) -> SyncReport: ...
    async def catch_up(self, engine: str, version: int, named: Named) -> SyncReport: ...


class Exporter(Protocol):
    """The part of a trainer backend the hand-off needs (FSDP and Megatron both have it)."""

    def export_sync_state(self, flat: bool = False, dtype: torch.dtype | None = None) -> Named | FlatWeights: ...


def _host_copy(w: FlatWeights, reuse: torch.Tensor | None) -> FlatWeights:
    """A host copy of a flat export, into `reuse` when it fits; pinned and on a side stream for CUDA."""
    buf = w.buffer
    dst = reuse if reuse is not None and reuse.shape == buf.shape and reuse.dtype == buf.dtype else None
    if buf.device.type == "cuda":
        dst = dst if dst is not None else torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
        side = torch.cuda.Stream(device=buf.device)
        side.wait_stream(torch.cuda.current_stream(buf.device))  # the export's fill has been issued
        with torch.cuda.stream(side):
            dst.copy_(buf, non_blocking=True)
        side.synchronize()
    else:
        dst = dst if dst is not None else torch.empty_like(buf)
        dst.copy_(buf)
    return FlatWeights(dst, w.plan)


def hand_off_metrics(rep: SyncReport, export_s: float, total_s: float, payload_bytes: int) -> dict[str, float]:
    """perf/* and sync/* of one hand-off (gathered or sharded): `total_s` is what the trainer
    waited for (export + push + announce), `export_s` the export (gather or slices, cast into the
    send buffer), `payload_bytes` the version in full (`sync/bytes` is less with deltas)."""
    return {
        "perf/sync_s": total_s,
        "perf/export_s": export_s,
        "perf/push_s": rep.seconds,  # pause -> stage -> commit -> resume
        "perf/pause_s": rep.pause_s + rep.resume_s,
        "perf/transfer_s": rep.transfer_s,  # moving every bucket / byte range onto the engines
        "perf/commit_s": rep.commit_s,
        "sync/bytes": float(rep.bytes),  # per engine
        "sync/gbps": rep.bytes / total_s / 1e9 if total_s > 0 else 0.0,  # end to end
        "sync/transfer_gbps": rep.bytes / rep.transfer_s / 1e9 if rep.transfer_s > 0 else 0.0,
        "sync/payload_bytes": float(payload_bytes),
        "sync/dead_engines": float(len(rep.dead)),
        # a sharded sync has no tensor fallback (a decline fails its push): 0 there
        "sync/plan_declined": float(len(rep.declined)),
    }


class WeightPublisher:
    """Exports a trainer's weights and, on rank 0, pushes them and catches engines up."""

    def __init__(self, cfg: SyncConfig, exporter: Exporter, sync: Pusher | None,
                 fp8_spec: ModelSpec | None = None) -> None:
        self.cfg = cfg
        self.exporter = exporter
        # Under the FP8 contract (docs/fp8.md) the export goes tensor by tensor, cast to the wire
        # dtype here and then to codes + scales; `sync` must then move tensors as given
        # (sync.dtype = 'same': a cast would destroy the codes).
        self.fp8_spec = fp8_spec if fp8_spec is not None and fp8_block(fp8_spec) else None
        self.sync = sync  # None on ranks other than 0: they only take part in the gather
        self.lock = asyncio.Lock()  # export + push vs catch-up: both read the export buffer
        self.last_version = -1
        self._source: FlatWeights | dict[str, torch.Tensor] | None = None  # what catch-ups send
        self._copy: asyncio.Task[FlatWeights] | None = None  # host_copy mode: the running copy
        self.copy_s = 0.0  # duration of the last background host copy (off the critical path)
        self.payload_bytes = 0

    # ------------------------------------------------------------------ export + push
    def _export_blocking(self) -> Named | FlatWeights:
        dt = self.cfg.wire_dtype()
        dtype = None if dt is None else getattr(torch, dt)
        if self.fp8_spec is not None:
            named = self.exporter.export_sync_state(flat=False)
            assert not isinstance(named, FlatWeights)
            cast = ((n, t.to(dtype) if dtype is not None else t) for n, t in named)
            state: Named | FlatWeights = fp8_export(cast, self.fp8_spec)
        else:
            state = self.exporter.export_sync_state(flat=self.cfg.flat, dtype=dtype)
        if self.sync is None and not isinstance(state, FlatWeights):
            for _ in state:  # other ranks drain the gather collective, in this thread too
                pass
        return state

    async def export(self) -> Named | FlatWeights:
        """Gather (and cast) this rank's export in a worker thread. Hold `lock` around it."""
        if self._copy is not None:
            await self._copy  # the background host copy still reads the buffer being refilled
        return await asyncio.to_thread(self._export_blocking)

    async def hand_off(self, version: int, announce: Callable[[], Coroutine[Any, Any, Any]]) -> dict[str, float]:
        """Export, push `version` to every engine, then `announce` it; perf/* and sync/* metrics."""
        t0 = time.perf_counter()
        async with self.lock:
            state = await self.export()
            t_export = time.perf_counter() - t0
            if self.sync is None:
                return {"perf/export_s": t_export}
            rep = await self._push(version, state)
        await announce()
        return {**hand_off_metrics(rep, t_export, time.perf_counter() - t0, self.payload_bytes),
                "perf/catchup_copy_s": self.copy_s}  # background, not on the critical path

    async def _push(self, version: int, state: Named | FlatWeights) -> SyncReport:
        assert self.sync is not None
        if isinstance(state, FlatWeights):
            rep = await self.sync.push(version, state)
            self.payload_bytes = state.plan.nbytes
            if self.cfg.catchup_from_buffer:
                self._source = state  # valid until the next export, which takes the lock
            else:
                prev = self._source.buffer if isinstance(self._source, FlatWeights) else None
                self._source = None
                self._copy = asyncio.create_task(self._background_copy(state, prev), name="host-copy")
        else:
            copy: dict[str, torch.Tensor] = {}

            def keep() -> Iterator[tuple[str, torch.Tensor]]:
                for name, t in state:
                    copy[name] = t.detach().to("cpu", copy=True)
                    yield name, t

            rep = await self.sync.push(version, keep())
            self._source = copy
            self.payload_bytes = sum(t.numel() * t.element_size() for t in copy.values())
        self.last_version = version
        return rep

    async def _background_copy(self, state: FlatWeights, reuse: torch.Tensor | None) -> FlatWeights:
        t0 = time.perf_counter()
        out = await asyncio.to_thread(_host_copy, state, reuse)
        self.copy_s = time.perf_counter() - t0
        self._source = out
        return out

    # ------------------------------------------------------------------ catch-up
    async def source(self) -> tuple[int, Named] | None:
        """(version, weights) of the last push, as a catch-up or snapshot sends them."""
        if self._copy is not None:
            await self._copy
        if self._source is None:
            return None
        src = self._source
        return self.last_version, (src if isinstance(src, FlatWeights) else src.items())

    async def catch_up(self, engine: str) -> bool:
        """Bring one lagging engine to the last pushed version; whether it was done."""
        assert self.sync is not None
        async with self.lock:  # no export refills the buffer while it is being sent
            got = await self.source()
            if got is None:
                return False
            version, named = got
            try:
                await self.sync.catch_up(engine, version, named)
            except MilesError as exc:
                log.warning("engine_catch_up_failed", engine=engine, version=version, error=str(exc))
                return False
        log.warning("engine_caught_up", engine=engine, version=version)
        return True
