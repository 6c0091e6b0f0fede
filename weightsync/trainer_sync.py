"""The trainer side's weight-sync objects: the coordinator of each design with its channel.

`GatheredSync` (one process holds the model and pushes it: a flat export as a sharded sync
with one rank, weightsync/one_rank.py; the rest by `GatheredCoordinator`,
weightsync/coordinator.py) and `ShardedSync` (every trainer rank sends its own slices:
`ShardedCoordinator`, weightsync/shard_coordinator.py), each built from the sync config over
a `SyncLink` (the control path to the engines) and the address engines reach this process
at. weightsync/actor_wire.py binds them to the actor wire (`WeightSync`, `ShardedWeightSync`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from miles.core.schema.sync import SyncConfig
from miles.transport.bulk.base import BulkSender, SenderPlace, make_sender
from miles.weightsync.coordinator import GatheredCoordinator, SyncLink, adopt
from miles.weightsync.flat import FlatWeights
from miles.weightsync.one_rank import SoloRankGroup, one_rank_export, one_rank_plan
from miles.weightsync.push_round import SyncReport
from miles.weightsync.rank_group import RankGroup, TorchRankGroup
from miles.weightsync.shard_coordinator import ShardedCoordinator, ShardedOptions
from miles.weightsync.shard_plan import ShardExport, TransferPlan

# Transports a gathered flat export goes over as a one-rank sharded sync (weightsync/one_rank.py); empty
# it to send every flat export through GatheredCoordinator again. Not yet broadcast, though its sharded
# sender with one rank sends each bucket in one collective to every engine as the gathered one does
# (`BroadcastSender.fanout`, tested in tests/sync/test_sync_one_rank.py): on the CPU that push measured
# 4-15 % slower than the gathered one (bench/results/weight_sync_one_rank_cpu.txt), cause not found,
# and NCCL's is not measured yet (bench/weight_sync_one_rank.py --device cuda --transports broadcast).
ONE_RANK_TRANSPORTS: frozenset[str] = frozenset({"zmq", "ucx"})


class GatheredSync:
    """Trainer rank 0's gathered sync: pushes weight versions it holds whole to a set of engines.

    A flat export (weightsync/flat.py) over zmq or ucx is a sharded sync with one rank: it goes
    through `ShardedCoordinator` on a `SoloRankGroup` (weightsync/one_rank.py), as every trainer
    rank's slices do under `sync.sharded`. The rest goes through `GatheredCoordinator`
    (weightsync/coordinator.py; its docstring says why each is not a one-rank sharded push yet):
    tensor-by-tensor exports (LoRA adapters, FP8 codes + scales), an export in another dtype than
    the wire's or of several dtypes, an engine that declines the flat plan (SGLang's bucket
    updates: it is asked before the push and then sent tensors), and the disk_delta and cuda_ipc
    channels; broadcast too, for now (`ONE_RANK_TRANSPORTS` says why). Both coordinators share the engine list and the versions each engine
    committed; each reopens its channel when the other one ran last (an engine holds one
    receiver at a time).
    """

    def __init__(self, link: SyncLink, cfg: SyncConfig, engines: list[str], device: str | torch.device = "cpu",
                 advertise: str = "127.0.0.1") -> None:
        self.cfg = cfg
        self.link = link
        self.device = torch.device(device)
        self.advertise = advertise
        # The device picks broadcast's backend (NCCL for a CUDA trainer, gloo for a CPU one); ucx keeps GPU weights on the GPU.
        self.place = SenderPlace(0, 1, advertise, self.device)
        self.coordinator = GatheredCoordinator(link, make_sender(cfg, self.place), cfg, engines, self.device)
        self.one_rank: ShardedCoordinator | None = None
        if cfg.transport in ONE_RANK_TRANSPORTS:
            self.one_rank = self._solo(cfg, self.coordinator.engines, cfg.pause_mode, cfg.verify_every)
            # one engine set and one record of versions, whichever coordinator pushed
            self.one_rank.engines = self.coordinator.engines
            self.one_rank.versions = self.coordinator.versions
        self._last: GatheredCoordinator | ShardedCoordinator | None = None
        self._transfer: tuple[str, TransferPlan | None] = ("", None)  # one-rank plan per flat plan digest
        self._declined: tuple[str, tuple[str, ...]] | None = None  # (plan, engines) the engines declined

    def _solo(self, cfg: SyncConfig, engines: list[str], pause_mode: str, verify_every: int) -> ShardedCoordinator:
        """A sharded coordinator of one rank over `cfg`'s channel."""
        sender = make_sender(cfg, self.place, sharded=True)
        # No receive-ahead (ucx): it lets several ranks' bytes flow into an engine at once; from one rank
        # it would only add a copy, where a bucket is received straight into the staging slots.
        opts = ShardedOptions(cfg.bucket_mib << 20, cfg.pipeline_depth, pause_mode, verify_every)
        return ShardedCoordinator(self.link, SoloRankGroup(), sender, engines, opts)

    @property
    def engines(self) -> list[str]:
        return self.coordinator.engines

    @property
    def sender(self) -> BulkSender:
        """The gathered coordinator's channel (what tensor-by-tensor pushes and delta channels use)."""
        return self.coordinator.sender

    @property
    def versions(self) -> dict[str, int]:
        """The last version each engine committed through this sync."""
        return self.coordinator.versions

    def _export(self, named: Iterable[tuple[str, torch.Tensor]]) -> ShardExport | None:
        """`named` as a one-rank sharded export when it is a flat export in the wire dtype, else None."""
        if not isinstance(named, FlatWeights):
            return None
        dtype = self.cfg.wire_dtype()
        if dtype is not None and any(d != dtype for d in named.plan.dtypes):
            return None  # converted tensor by tensor on the gathered path
        if self._transfer[0] != named.plan.digest:
            self._transfer = (named.plan.digest, one_rank_plan(named.plan))
        return one_rank_export(named, self._transfer[1]) if self._transfer[1] is not None else None

    async def _taken(self, coord: ShardedCoordinator, export: ShardExport, engines: list[str]) -> bool:
        """Whether every engine takes the one-rank plan (asked once per plan and engine set)."""
        key = (export.plan.digest, tuple(engines))
        if self._declined == key:
            return False
        declined = await coord.offer_plan(export.plan, list(engines), [])
        if declined:
            self._declined = key  # the gathered coordinator asks again, warns and counts the decline
        return not declined

    def _use(self, coord: GatheredCoordinator | ShardedCoordinator) -> None:
        """`coord` pushes next: it reopens its channel if the other one replaced the engines' receivers."""
        if self._last is not None and self._last is not coord:
            coord._forget()
        self._last = coord

    async def push(self, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        export = self._export(named) if self.one_rank is not None else None
        if self.one_rank is not None and export is not None and await self._taken(self.one_rank, export, self.engines):
            self._use(self.one_rank)
            return await self.one_rank.push(version, export)
        self._use(self.coordinator)
        return await self.coordinator.push(version, named)

    async def catch_up(self, engine: str, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Bring one (restarted or lagging) engine to `version` with a full copy over zmq (a flat
        export as a one-rank sharded push, else tensor by tensor). The engine joins the set."""
        export = self._export(named)
        if export is not None:
            sub = self._solo(dataclasses.replace(self.cfg, transport="zmq"), [engine], "none", 0)
            try:
                if await self._taken(sub, export, [engine]):
                    rep = await sub.push(version, export)
                    adopt(self.coordinator, engine, version, rep)  # both coordinators reopen for it
                    if self.one_rank is not None:
                        self.one_rank._forget()
                    return rep
            finally:
                await sub.close()
        rep = await self.coordinator.catch_up(engine, version, named)
        if self.one_rank is not None:
            self.one_rank._forget()
        return rep

    async def close(self) -> None:
        await self.coordinator.close()
        if self.one_rank is not None:
            await self.one_rank.close()

    async def verify(self, engines: list[str], expected: dict[str, str]) -> bool:
        return await self.coordinator.verify(engines, expected)

    def _forget(self) -> None:
        """Reconnect the channel and resend the flat plan on the next push."""
        self.coordinator._forget()
        if self.one_rank is not None:
            self.one_rank._forget()


class ShardedSync:
    """Every trainer rank's sharded sync: each rank sends its own slices (trainer
    `export_sharded_state`) straight to every engine; the protocol is `ShardedCoordinator`.
    Every rank constructs one and calls `push` / `catch_up` / `close` together (they are
    collectives over `group`, default: the trainer's torch.distributed group).
    """

    def __init__(self, link: SyncLink, cfg: SyncConfig, engines: list[str], device: str | torch.device = "cpu",
                 group: RankGroup | None = None, bucket_bytes: int | None = None, delta: bool = False,
                 advertise: str = "127.0.0.1") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.group = group if group is not None else TorchRankGroup("cuda" if self.device.type == "cuda" else "cpu")
        self.advertise = advertise
        self.link = link
        # delta: only changed words when that moves fewer bytes (transport/bulk/shard_delta.py; +1 shard)
        self.opts = ShardedOptions(bucket_bytes or cfg.bucket_mib << 20, cfg.pipeline_depth, cfg.pause_mode,
                                   cfg.verify_every, delta, cfg.receive_ahead_mib << 20)
        self.coordinator = ShardedCoordinator(self.link, self.group, self._sender(cfg), engines, self.opts)

    def _sender(self, cfg: SyncConfig) -> BulkSender:  # sync.transport: the loader allows only zmq, ucx, broadcast
        place = SenderPlace(self.group.rank, self.group.size, self.advertise, self.device)
        return make_sender(cfg, place, sharded=True)

    @property
    def engines(self) -> list[str]:
        return self.coordinator.engines

    async def push(self, version: int, export: ShardExport) -> SyncReport:
        return await self.coordinator.push(version, export)

    async def catch_up(self, engine: str, version: int, export: ShardExport) -> SyncReport:
        """Bring one engine to `version` over zmq, every rank sending its shard (a collective)."""
        return await self.coordinator.catch_up(engine, version, export,
                                               self._sender(dataclasses.replace(self.cfg, transport="zmq")))

    async def close(self) -> None:
        await self.coordinator.close()
