"""Every trainer rank's weight hand-off for a sharded sync: export its own slices, push them.

The sharded counterpart of `WeightPublisher` (weightsync/publisher.py), with the same
surface the trainer loop uses (`hand_off`, `lock`, `last_version`, `source`, `catch_up`):

- every rank exports (`export_sharded_state`: its slices cast into its send buffer, in a
  worker thread) and pushes through `ShardedWeightSync` (a collective); rank 0 announces;
- no process holds the whole model, so there is no catch-up source: an engine that comes
  back (restarted, or dropped as dead) is reconnected by the next push and gets that version
  in full (deltas only go to engines that committed their base); `source()` is None (an
  evaluation snapshot needs the gathered path).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import torch

from miles.core.logging import get_logger
from miles.core.schema.sync import SyncConfig
from miles.weightsync.publisher import hand_off_metrics
from miles.weightsync.push_round import SyncReport
from miles.weightsync.rank_group import RankGroup
from miles.weightsync.shard_coordinator import ShardedCoordinator
from miles.weightsync.shard_plan import ShardExport

log = get_logger("miles.trainer")


class ShardPusher(Protocol):
    """Every rank's way to the engines (weightsync/actor_wire.py `ShardedWeightSync`)."""

    group: RankGroup
    coordinator: ShardedCoordinator

    async def push(self, version: int, export: ShardExport) -> SyncReport: ...


class ShardExporter(Protocol):
    """The part of a trainer backend a sharded hand-off needs (FSDP has it)."""

    def export_sharded_state(self, dtype: torch.dtype | None = None) -> ShardExport: ...


class ShardedPublisher:
    def __init__(self, cfg: SyncConfig, exporter: ShardExporter, sync: ShardPusher) -> None:
        self.cfg, self.exporter, self.sync = cfg, exporter, sync
        self.rank = sync.group.rank
        self.lock = asyncio.Lock()
        self.last_version = -1
        self.payload_bytes = 0
        self._told: set[str] = set()

    async def hand_off(self, version: int, announce: Callable[[], Coroutine[Any, Any, Any]]) -> dict[str, float]:
        """Export this rank's slices, push `version` from every rank, then (rank 0) `announce` it."""
        t0 = time.perf_counter()
        dt = self.cfg.wire_dtype()
        async with self.lock:
            export = await asyncio.to_thread(self.exporter.export_sharded_state,
                                             None if dt is None else getattr(torch, dt))
            t_export = time.perf_counter() - t0
            rep = await self.sync.push(version, export)
            self.payload_bytes = rep.full_bytes
            self.last_version = version
        if self.rank == 0:
            await announce()
        return hand_off_metrics(rep, t_export, time.perf_counter() - t0, rep.full_bytes)

    async def source(self) -> None:
        """No process holds the whole model: nothing to send a catch-up or a snapshot from."""
        return None

    async def catch_up(self, engine: str) -> bool:
        """Rank 0's engine watcher found `engine` behind (restarted): the next push reopens the
        channel and sends it the whole version (the ranks follow rank 0's decision). Returns
        False: it is not up to date until then."""
        async with self.lock:  # not in the middle of a push
            self.sync.coordinator.forget_engine(engine)
        if engine not in self._told:
            self._told.add(engine)
            log.warning("engine_catch_up_at_next_push", engine=engine, version=self.last_version,
                        reason="sharded sync: no rank holds the whole model to send it now")
        return False
