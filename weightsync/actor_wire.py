"""The weight sync bound to the actor wire: engines reached by actor asks, this process's address.

`GatheredSync` and `ShardedSync` (weightsync/trainer_sync.py) talk to engines through a
`SyncLink`; here is the one miles uses, `ActorSyncLink`: each step one ask on the actor wire
with the step deadline. The wire is a Protocol (`Wire`: what the sync needs of the actor host,
`Host` satisfies it), so this package imports nothing of actors/: the trainer actor hands its
host in, and the sync calls the wire, never the other way round.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from miles.core.schema.sync import SyncConfig
from miles.weightsync.control import AbortVersion, Checksums, Commit, Pause, Resume
from miles.weightsync.messages import BulkClose, BulkOpen, BulkPlan, BulkRecv, FlatRange, Stage
from miles.weightsync.rank_group import RankGroup
from miles.weightsync.trainer_sync import GatheredSync, ShardedSync


class Wire(Protocol):
    """What the sync needs of the actor host (actors/runtime/host_view.py `ActorHost` has it)."""

    @property
    def address(self) -> str:
        """This process's ROUTER address (tcp://ip:port or ipc://...)."""
        ...

    async def ask(self, name: str, msg: Any, timeout: float) -> Any:
        """Send `msg` to actor `name`, wait up to `timeout` for its reply; a gone actor raises
        ActorDeadError, any other failure a MilesError."""
        ...


def advertise_address(wire: Wire, cfg: SyncConfig) -> str:
    """The address engines reach this process at: config, else the wire's TCP address."""
    if cfg.advertise_addr:
        return cfg.advertise_addr
    if wire.address.startswith("tcp://"):
        ip = wire.address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
        if ip not in ("0.0.0.0", "*", "::"):
            return ip
    return "127.0.0.1"


class WeightSync(GatheredSync):
    """Trainer rank 0's gathered sync to the engine actors reached over `host`."""

    def __init__(self, host: Wire, cfg: SyncConfig, engines: list[str], device: str | torch.device = "cpu") -> None:
        self.host = host
        super().__init__(ActorSyncLink(host, cfg.step_timeout_s), cfg, engines, device, advertise_address(host, cfg))


class ShardedWeightSync(ShardedSync):
    """Every trainer rank's sharded sync to the engine actors reached over `host` (collectives over `group`)."""

    def __init__(self, host: Wire, cfg: SyncConfig, engines: list[str], device: str | torch.device = "cpu",
                 group: RankGroup | None = None, bucket_bytes: int | None = None, delta: bool = False) -> None:
        self.host = host
        super().__init__(ActorSyncLink(host, cfg.step_timeout_s), cfg, engines, device, group, bucket_bytes, delta,
                         advertise_address(host, cfg))


class ActorSyncLink:
    """The coordinators' `SyncLink` (weightsync/coordinator.py) over the actor wire: each step
    one ask with the step deadline (sync.step_timeout_s)."""

    def __init__(self, wire: Wire, timeout_s: float) -> None:
        self.wire, self.timeout_s = wire, timeout_s

    async def _ask(self, engine: str, msg: Any) -> Any:
        return await self.wire.ask(engine, msg, self.timeout_s)

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
