"""The trainer side's weight-sync objects: the coordinator of each design with its channel.

`GatheredSync` (one process holds the model and pushes it: as a sharded sync with one rank,
weightsync/one_rank.py, over zmq, ucx and gloo broadcast; the rest by `GatheredCoordinator`,
weightsync/coordinator.py) and `ShardedSync` (every trainer rank sends its own slices:
`ShardedCoordinator`, weightsync/shard_coordinator.py), each built from the sync config over
a `SyncLink` (the control path to the engines) and the address engines reach this process
at. weightsync/actor_wire.py binds them to the actor wire (`WeightSync`, `ShardedWeightSync`).
"""

from __future__ import annotations

import asyncio
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

# Transports a gathered export goes over as a one-rank sharded sync (weightsync/one_rank.py); empty it to
# send every export through GatheredCoordinator again. broadcast goes one-rank from a CPU trainer (gloo):
# its sharded sender with one rank sends each bucket in one collective to every engine, as the gathered one
# does (`BroadcastSender.fanout`). It measured 8-17 % slower than the gathered push on the CPU while the
# one-rank plan cut its buckets at every `bucket_bytes` across tensors (full-size buckets, each broadcast
# slower per byte); cut at tensor boundaries as the gathered flat path cuts (`OneRankPlan.buckets`) it takes
# the same time (bench/results/weight_sync_one_rank_s19.txt). A CUDA trainer's broadcast (NCCL) stays
# gathered until its one-rank push is measured on a GPU (bench/weight_sync_one_rank.py --device cuda
# --transports broadcast).
ONE_RANK_TRANSPORTS: frozenset[str] = frozenset({"zmq", "ucx", "broadcast"})
ONE_RANK_ON_CPU_ONLY: frozenset[str] = frozenset({"broadcast"})


def goes_one_rank(transport: str, device: torch.device) -> bool:
    """Whether `GatheredSync` pushes over `transport` from a trainer on `device` as a one-rank sharded sync."""
    return transport in ONE_RANK_TRANSPORTS and (device.type == "cpu" or transport not in ONE_RANK_ON_CPU_ONLY)


class GatheredSync:
    """Trainer rank 0's gathered sync: pushes weight versions it holds whole to a set of engines.

    Over zmq, ucx and (from a CPU trainer) broadcast every export is a sharded sync with one rank:
    it goes through `ShardedCoordinator` on a `SoloRankGroup` (weightsync/one_rank.py), as every
    trainer rank's slices do under `sync.sharded`. A flat export (weightsync/flat.py) sends from
    its own buffer; a tensor-by-tensor one (a LoRA adapter payload, FP8 codes + scales) is packed
    into one flat buffer first (`_flat`: one copy, in the wire dtype), tensors of several dtypes
    and 0-d ones included. What still goes through `GatheredCoordinator` (weightsync/coordinator.py
    says why): an export whose engines decline its flat plan (SGLang: no staging slots; a float
    export to FP8 engines: quantized on arrival), a flat export in another dtype than the wire's,
    the disk_delta and cuda_ipc channels, and broadcast from a CUDA trainer (`ONE_RANK_TRANSPORTS`).
    Both coordinators share the engine list and the versions each engine committed; each reopens
    its channel when the other one ran last (an engine holds one receiver at a time).
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
        if goes_one_rank(cfg.transport, self.device):
            self.one_rank = self._solo(cfg, self.coordinator.engines, cfg.pause_mode, cfg.verify_every)
            # one engine set and one record of versions, whichever coordinator pushed
            self.one_rank.engines = self.coordinator.engines
            self.one_rank.versions = self.coordinator.versions
        self._last: GatheredCoordinator | ShardedCoordinator | None = None
        self._transfer: tuple[str, TransferPlan | None] = ("", None)  # one-rank plan per flat plan digest
        self._declined: tuple[str, tuple[str, ...]] | None = None  # (plan, engines) the engines declined
        self._packed: FlatWeights | None = None  # the last tensor-by-tensor export, packed (`_flat`)
        self._unpacked: tuple[str, ...] = ()  # engines that declined a packed export: not packed again

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

    async def _flat(self, named: Iterable[tuple[str, torch.Tensor]],
                    reuse: bool = True) -> Iterable[tuple[str, torch.Tensor]]:
        """`named`, a tensor-by-tensor export packed into a flat one when it would go one-rank
        (one copy, cast to the wire dtype as the gathered push would; in host memory where the
        channel carries host memory). `reuse`: refill the last packed buffer (pushes, which the
        publisher never runs two at a time); a catch-up packs its own. The export is drawn and
        copied in a worker thread (an FP8 export quantizes as it is drawn): the loop keeps
        answering heartbeats meanwhile."""
        if isinstance(named, FlatWeights) or self.one_rank is None or self._unpacked == tuple(self.engines):
            return named
        wire = self.cfg.wire_dtype()
        host = self.cfg.transport == "zmq" or self.device.type == "cpu"
        packed = await asyncio.to_thread(FlatWeights.pack, named, torch.device("cpu") if host else None,
                                         self._packed if reuse else None, getattr(torch, wire) if wire else None)
        if reuse:
            self._packed = packed
        return packed

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
        packed = await self._flat(named)
        export = self._export(packed) if self.one_rank is not None else None
        if self.one_rank is not None and export is not None and await self._taken(self.one_rank, export, self.engines):
            self._use(self.one_rank)
            return await self.one_rank.push(version, export)
        if packed is not named:  # declined (SGLang: no staging slots): later exports go as they come
            self._unpacked, self._packed = tuple(self.engines), None
        named = packed
        self._use(self.coordinator)
        return await self.coordinator.push(version, named)

    async def catch_up(self, engine: str, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Bring one (restarted or lagging) engine to `version` with a full copy over zmq (a flat
        export as a one-rank sharded push, else tensor by tensor). The engine joins the set."""
        named = await self._flat(named, reuse=False)
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
