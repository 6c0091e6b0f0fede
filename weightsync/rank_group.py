"""The trainer ranks' side-channel a sharded sync agrees through (what to open, who failed, commit).

`RankGroup` is the contract the coordinator needs; `TorchRankGroup` runs it over the trainer's
torch.distributed group. Objects travel as msgpack (never pickle) in a byte tensor; the
blocking collectives run in a worker thread so the actor loop keeps serving heartbeats.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import msgpack
import torch


class RankGroup(Protocol):
    """Every trainer rank calls each method in the same order (they are collectives)."""

    rank: int
    size: int

    async def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's msgpack-able `obj`, in rank order, on every rank."""
        ...

    async def send(self, t: torch.Tensor, dst: int) -> None:
        """Point to point: this rank's bytes `t` to rank `dst` (verification streams)."""
        ...

    async def recv(self, t: torch.Tensor, src: int) -> None: ...


class TorchRankGroup:
    """A RankGroup over torch.distributed's default group (or `group`), on `device`."""

    def __init__(self, device: torch.device | str = "cpu", group: Any = None) -> None:
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.device = torch.device(device)

    def _all_gather(self, obj: Any) -> list[Any]:
        data = torch.frombuffer(bytearray(msgpack.packb(obj, use_bin_type=True)), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.size)]
        self.dist.all_gather(sizes, n, group=self.group)
        most = int(max(s.item() for s in sizes))
        buf = torch.zeros(most, dtype=torch.uint8, device=self.device)
        buf[:data.numel()] = data.to(self.device)
        outs = [torch.empty_like(buf) for _ in range(self.size)]
        self.dist.all_gather(outs, buf, group=self.group)
        return [msgpack.unpackb(o[:int(s.item())].cpu().numpy().tobytes(), raw=False)
                for o, s in zip(outs, sizes, strict=True)]

    async def all_gather(self, obj: Any) -> list[Any]:
        return await asyncio.to_thread(self._all_gather, obj)

    async def send(self, t: torch.Tensor, dst: int) -> None:
        await asyncio.to_thread(self.dist.send, t, dst, self.group)

    async def recv(self, t: torch.Tensor, src: int) -> None:
        await asyncio.to_thread(self.dist.recv, t, src, self.group)
