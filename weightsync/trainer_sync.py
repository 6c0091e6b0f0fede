"""The trainer side's weight-sync objects: the coordinator of each design with its channel.

`GatheredSync` (one process holds the model and pushes it: `GatheredCoordinator`,
weightsync/coordinator.py) and `ShardedSync` (every trainer rank sends its own slices:
`ShardedCoordinator`, weightsync/shard_coordinator.py), each built from the sync config over
a `SyncLink` (the control path to the engines) and the address engines reach this process
at. weightsync/actor_wire.py binds them to the actor wire (`WeightSync`, `ShardedWeightSync`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch

from miles.core.schema.sync import SyncConfig
from miles.transport.bulk.base import BulkSender, make_sender
from miles.transport.bulk.shard_channels import ShardTransport, make_shard_sender
from miles.transport.bulk.wire_plan import SegmentSender
from miles.weightsync.coordinator import GatheredCoordinator, SyncLink
from miles.weightsync.push_round import SyncReport
from miles.weightsync.rank_group import RankGroup, TorchRankGroup
from miles.weightsync.shard_coordinator import ShardedCoordinator, ShardedOptions
from miles.weightsync.shard_plan import ShardExport


class GatheredSync:
    """Trainer rank 0's gathered sync: pushes weight versions it holds whole to a set of engines
    over the configured bulk channel (the protocol: `GatheredCoordinator`)."""

    def __init__(self, link: SyncLink, cfg: SyncConfig, engines: list[str], device: str | torch.device = "cpu",
                 advertise: str = "127.0.0.1") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        sender: BulkSender = make_sender(cfg)
        if cfg.transport in ("broadcast", "ucx") and isinstance(sender, SegmentSender):
            # Broadcast picks NCCL for a CUDA trainer, gloo for a CPU one; ucx keeps GPU weights on the GPU.
            sender.device = self.device
        if hasattr(sender, "advertise"):
            sender.advertise = advertise
        self.coordinator = GatheredCoordinator(link, sender, cfg, engines, self.device)

    @property
    def engines(self) -> list[str]:
        return self.coordinator.engines

    @property
    def sender(self) -> BulkSender:
        return self.coordinator.sender

    @property
    def versions(self) -> dict[str, int]:
        """The last version each engine committed through this coordinator."""
        return self.coordinator.versions

    async def push(self, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        return await self.coordinator.push(version, named)

    async def catch_up(self, engine: str, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Bring one (restarted or lagging) engine to `version` with a full copy over the zmq path."""
        return await self.coordinator.catch_up(engine, version, named)

    async def close(self) -> None:
        await self.coordinator.close()

    async def verify(self, engines: list[str], expected: dict[str, str]) -> bool:
        return await self.coordinator.verify(engines, expected)

    def _forget(self) -> None:
        """Reconnect the channel and resend the flat plan on the next push."""
        self.coordinator._forget()


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
        self.coordinator = ShardedCoordinator(self.link, self.group, self._sender(cast(ShardTransport, cfg.transport)),
                                              engines, self.opts)

    def _sender(self, tag: ShardTransport) -> Any:  # sync.transport: the loader allows only these under sync.sharded
        return make_shard_sender(tag, self.group.rank, self.group.size, self.cfg.step_timeout_s, self.advertise,
                                 self.device)

    @property
    def engines(self) -> list[str]:
        return self.coordinator.engines

    async def push(self, version: int, export: ShardExport) -> SyncReport:
        return await self.coordinator.push(version, export)

    async def catch_up(self, engine: str, version: int, export: ShardExport) -> SyncReport:
        """Bring one engine to `version` over zmq, every rank sending its shard (a collective)."""
        return await self.coordinator.catch_up(engine, version, export, self._sender("zmq"))

    async def close(self) -> None:
        await self.coordinator.close()
