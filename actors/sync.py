"""The weight sync bound to the actor wire: engines reached by actor asks, this process's address.

The sync itself lives in weightsync/ (weightsync/trainer_sync.py `GatheredSync` and
`ShardedSync` over the coordinators); here only what ties it to the actor runtime: `ActorSyncLink`, their `SyncLink`
over actor asks with the step deadline, the address engines reach this process at, and the
two classes the trainer builds from its host, `WeightSync` and `ShardedWeightSync`.
"""

from __future__ import annotations

from typing import Any

import torch

from miles.actors.messages import AbortVersion, Checksums, Commit, Pause, Resume
from miles.actors.runtime.host_view import ActorHost
from miles.core.schema.sync import SyncConfig
from miles.weightsync.messages import BulkClose, BulkOpen, BulkPlan, BulkRecv, FlatRange, Stage
from miles.weightsync.rank_group import RankGroup
from miles.weightsync.trainer_sync import GatheredSync, ShardedSync


def _advertise(host: ActorHost, cfg: SyncConfig) -> str:
    """The address engines reach this process at: config, else the actor host's TCP address."""
    if cfg.advertise_addr:
        return cfg.advertise_addr
    if host.address.startswith("tcp://"):
        ip = host.address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
        if ip not in ("0.0.0.0", "*", "::"):
            return ip
    return "127.0.0.1"


class WeightSync(GatheredSync):
    """Trainer rank 0's gathered sync to engine actors of `host`."""

    def __init__(self, host: ActorHost, cfg: SyncConfig, engines: list[str], device: str | torch.device = "cpu") -> None:
        self.host = host
        super().__init__(ActorSyncLink(host, cfg.step_timeout_s), cfg, engines, device, _advertise(host, cfg))


class ShardedWeightSync(ShardedSync):
    """Every trainer rank's sharded sync to engine actors of `host` (collectives over `group`)."""

    def __init__(self, host: ActorHost, cfg: SyncConfig, engines: list[str], device: str | torch.device = "cpu",
                 group: RankGroup | None = None, bucket_bytes: int | None = None, delta: bool = False) -> None:
        self.host = host
        super().__init__(ActorSyncLink(host, cfg.step_timeout_s), cfg, engines, device, group, bucket_bytes, delta,
                         _advertise(host, cfg))


class ActorSyncLink:
    """The sharded coordinator's SyncLink (weightsync/coordinator.py) over the actor wire:
    each step one ask with the step deadline (sync.step_timeout_s)."""

    def __init__(self, host: ActorHost, timeout_s: float) -> None:
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
        return await self._ask(engine, BulkPlan(plan))

    async def stage(self, engine: str, version: int, names: list[str], tensors: list[torch.Tensor]) -> int:
        return await self._ask(engine, Stage(version, names, tensors))

    async def recv(self, engine: str, version: int, header: dict[str, Any]) -> int:
        return await self._ask(engine, BulkRecv(version, header))

    async def range(self, engine: str, version: int, digest: str, lo: int, hi: int, header: dict[str, Any],
                    data: torch.Tensor | None = None) -> int:
        return await self._ask(engine, FlatRange(version, digest, lo, hi, header, data))

    async def commit(self, engine: str, version: int) -> None:
        await self._ask(engine, Commit(version))

    async def abort(self, engine: str, version: int) -> None:
        await self._ask(engine, AbortVersion(version))

    async def checksums(self, engine: str) -> dict[str, str]:
        return await self._ask(engine, Checksums())

    async def close(self, engine: str) -> None:
        await self._ask(engine, BulkClose())


