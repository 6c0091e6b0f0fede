"""Weight-sync actor shells: the trainer side's coordinators over the actor wire.

The protocol (pause -> buckets -> atomic commit -> resume, abort, catch-up, verify) lives in
plain classes: `GatheredCoordinator` (weightsync/coordinator.py: one process holds the model
and pushes it) and `ShardedCoordinator` (weightsync/shard_coordinator.py: every trainer rank
sends its own slices). Here: `ActorSyncLink`, their `SyncLink` over actor asks with the step
deadline, and the shells the trainer uses, `WeightSync` and `ShardedWeightSync`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from miles.actors.messages import AbortVersion, Checksums, Commit, Pause, Resume
from miles.actors.runtime.host import Host
from miles.core.schema.sync import SyncConfig
from miles.transport.bulk.base import BulkSender, make_sender
from miles.transport.bulk.shard_channels import ShardTransport, make_shard_sender
from miles.weightsync.coordinator import GatheredCoordinator
from miles.weightsync.messages import BulkClose, BulkOpen, BulkPlan, BulkRecv, FlatRange, Stage
from miles.weightsync.push_round import SyncReport
from miles.weightsync.rank_group import RankGroup, TorchRankGroup
from miles.weightsync.shard_coordinator import ShardedCoordinator, ShardedOptions
from miles.weightsync.shard_plan import ShardExport


def _advertise(host: Host, cfg: SyncConfig) -> str:
    """The address engines reach this process at: config, else the actor host's TCP address."""
    if cfg.advertise_addr:
        return cfg.advertise_addr
    if host.address.startswith("tcp://"):
        ip = host.address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
        if ip not in ("0.0.0.0", "*", "::"):
            return ip
    return "127.0.0.1"


class WeightSync:
    """Trainer rank 0's shell of the gathered sync: pushes weight versions it holds whole to a set
    of engine actors over the configured bulk channel (the protocol: `GatheredCoordinator`)."""

    def __init__(self, host: Host, cfg: SyncConfig, engines: list[str], device: str | torch.device = "cpu") -> None:
        self.host = host
        self.cfg = cfg
        self.device = torch.device(device)
        sender: BulkSender = make_sender(cfg)
        if cfg.transport in ("broadcast", "ucx"):
            # Broadcast picks NCCL for a CUDA trainer, gloo for a CPU one; ucx keeps GPU weights on the GPU.
            sender.device = self.device  # type: ignore[attr-defined]
        if hasattr(sender, "advertise"):
            sender.advertise = _advertise(host, cfg)
        self.coordinator = GatheredCoordinator(ActorSyncLink(host, cfg.step_timeout_s), sender, cfg, engines,
                                               self.device)

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


class ActorSyncLink:
    """The sharded coordinator's SyncLink (weightsync/coordinator.py) over the actor wire:
    each step one ask with the step deadline (sync.step_timeout_s)."""

    def __init__(self, host: Host, timeout_s: float) -> None:
        self.host, self.timeout_s = host, timeout_s

    async def _ask(self, engine: str, msg: Any) -> Any:
        return await self.host.ref(engine).ask(msg, timeout=self.timeout_s)

    async def pause(self, engine: str, mode: str) -> None:
        await self._ask(engine, Pause(mode))

    async def resume(self, engine: str) -> None:
        await self._ask(engine, Resume())

    async def open(self, engine: str, tag: str, info: dict[str, Any], bucket_bytes: int) -> None:
        await self._ask(engine, BulkOpen(tag, info, bucket_bytes))

    async def plan(self, engine: str, plan: dict[str, Any]) -> bool | str:
        return await self._ask(engine, BulkPlan(plan))  # type: ignore[no-any-return]

    async def stage(self, engine: str, version: int, names: list[str], tensors: list[torch.Tensor]) -> int:
        return await self._ask(engine, Stage(version, names, tensors))  # type: ignore[no-any-return]

    async def recv(self, engine: str, version: int, header: dict[str, Any]) -> int:
        return await self._ask(engine, BulkRecv(version, header))  # type: ignore[no-any-return]

    async def range(self, engine: str, version: int, digest: str, lo: int, hi: int, header: dict[str, Any],
                    data: torch.Tensor | None = None) -> int:
        return await self._ask(engine, FlatRange(version, digest, lo, hi, header, data))  # type: ignore[no-any-return]

    async def commit(self, engine: str, version: int) -> None:
        await self._ask(engine, Commit(version))

    async def abort(self, engine: str, version: int) -> None:
        await self._ask(engine, AbortVersion(version))

    async def checksums(self, engine: str) -> dict[str, str]:
        return await self._ask(engine, Checksums())  # type: ignore[no-any-return]

    async def close(self, engine: str) -> None:
        await self._ask(engine, BulkClose())


class ShardedWeightSync:
    """Every trainer rank's shell of a sharded sync: each rank sends its own
    slices (trainer `export_sharded_state`) straight to every engine; the protocol is
    `ShardedCoordinator`. Every rank constructs one and calls `push` / `catch_up` / `close`
    together (they are collectives over `group`, default: the trainer's torch.distributed group).
    """

    def __init__(self, host: Host, cfg: SyncConfig, engines: list[str], device: str | torch.device = "cpu",
                 group: RankGroup | None = None, bucket_bytes: int | None = None, delta: bool = False) -> None:
        self.host, self.cfg = host, cfg
        self.device = torch.device(device)
        self.group = group if group is not None else TorchRankGroup("cuda" if self.device.type == "cuda" else "cpu")
        self.advertise = _advertise(host, cfg)
        self.link = ActorSyncLink(host, cfg.step_timeout_s)
        # delta: only changed words when that moves fewer bytes (transport/bulk/shard_delta.py; +1 shard)
        self.opts = ShardedOptions(bucket_bytes or cfg.bucket_mib << 20, cfg.pipeline_depth, cfg.pause_mode,
                                   cfg.verify_every, delta, cfg.receive_ahead_mib << 20)
        self.coordinator = ShardedCoordinator(self.link, self.group, self._sender(cfg.transport), engines, self.opts)

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
