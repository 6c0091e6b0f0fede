"""The trainer actor's entry points into the weight sync: build the rank's publisher, watch the
engines for one that fell behind, push a snapshot to an evaluation engine.

The trainer actor (actors/trainer.py) calls these and holds no sync logic itself: which design
runs (gathered on rank 0, or sharded on every rank), the channel's settings under FP8, and the
catch-up of a restarted engine are decided here. The trainer backend and the actor wire come in
as Protocols (`SyncTrainer`, weightsync/actor_wire.py `Wire`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

import torch

from miles.core.errors import MilesError, TrainerError
from miles.core.schema import MilesConfig
from miles.models.config import ModelSpec
from miles.models.fp8_layout import fp8_block
from miles.weightsync.actor_wire import ShardedWeightSync, WeightSync, Wire
from miles.weightsync.publisher import Exporter, WeightPublisher
from miles.weightsync.shard_publisher import ShardedPublisher, ShardExporter

Publisher = WeightPublisher | ShardedPublisher
ServedVersion = Callable[[str], Awaitable[int]]  # the version an engine serves (its health reply)


class SyncTrainer(Exporter, ShardExporter, Protocol):
    """The part of a trainer backend the sync needs: its exports and its device."""

    @property
    def device(self) -> torch.device: ...


def make_publisher(cfg: MilesConfig, spec: ModelSpec, trainer: SyncTrainer, wire: Wire, engines: list[str],
                   rank: int) -> Publisher:
    """This rank's publisher: a sharded one on every rank (`sync.sharded`), else the gathered one,
    whose rank 0 alone pushes (the other ranks only take part in the export's gather)."""
    if cfg.sync.sharded:  # every rank sends its own slices (a collective per push)
        shard = ShardedWeightSync(wire, cfg.sync, engines, trainer.device, delta=cfg.sync.delta)
        return ShardedPublisher(cfg.sync, trainer, shard)
    fp8 = spec if fp8_block(spec) else None
    # the channel's settings were derived at load (under FP8 it moves the publisher's codes as given)
    sync = WeightSync(wire, cfg.channel_sync, engines, trainer.device) if rank == 0 else None
    return WeightPublisher(cfg.sync, trainer, sync, fp8_spec=fp8)


def pushes(pub: Publisher) -> bool:
    """Whether this rank drives the engines (and so watches them): rank 0."""
    return pub.rank == 0 if isinstance(pub, ShardedPublisher) else pub.sync is not None


async def watch_engines(pub: Publisher, served: ServedVersion, engines: list[str], poll_s: float) -> None:
    """Forever: catch up any engine that serves an older version than the last push (e.g. restarted).
    An engine that does not answer (dead or restarting) is tried again next round."""
    while True:
        await asyncio.sleep(poll_s)
        if pub.last_version < 0:
            continue
        for name in engines:
            try:
                version = await served(name)
            except MilesError:
                continue
            if version < pub.last_version:
                await pub.catch_up(name)


async def push_snapshot(pub: Publisher, wire: Wire, cfg: MilesConfig, engine: str, step: int) -> None:
    """Push the last pushed version to a snapshot evaluation engine (zmq, no pause). None has been
    pushed at step 0: the eval engine holds the initial weights then."""
    snap = WeightSync(wire, cfg.snapshot_sync, [engine])
    async with pub.lock:  # the export buffer is not refilled meanwhile
        got = await pub.source()
        if got is None and step > 0:
            raise TrainerError("snapshot eval: no weight version has been pushed yet")
        if got is not None:
            await snap.push(got[0], got[1])
