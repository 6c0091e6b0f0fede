"""`broadcast` channel: one torch.distributed group spanning trainer rank 0 and every engine.

The group is standalone (its own TCPStore, not the trainer's default group), created
once per peer set and torn down explicitly. Buckets go as one flat uint8 buffer per
bucket from rank 0; gloo on CPU, NCCL when the weights live on a GPU. Blocking
collectives run in a worker thread so the actor loops stay responsive.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import torch

from miles.core.errors import SyncError
from miles.core.logging import get_logger
from miles.transport.bulk.base import (
    BulkReceiver,
    BulkSender,
    Layout,
    LocalWeights,
    slot_region,
    unpack,
)
from miles.transport.bulk.buckets import Bucket

log = get_logger("miles.bulk.broadcast")


def _group(backend: str, addr: str, port: int, rank: int, world: int, timeout_s: float) -> tuple[Any, Any]:
    from torch.distributed import TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(addr, port, world, False, timeout=timeout, wait_for_workers=False)
    return store, _make_pg(backend, store, rank, world, timeout)


def _make_pg(backend: str, store: Any, rank: int, world: int, timeout: datetime.timedelta) -> Any:
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, world, opts)
    from torch.distributed import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, world, timeout)


def _shutdown(pg: Any) -> None:
    try:
        pg.shutdown()
    except RuntimeError as exc:  # a peer already gone: the group is dead either way
        log.warning("broadcast_group_shutdown_failed", error=str(exc))


# A run of tensors adjacent in the trainer's memory at least this large is broadcast from
# there (no pack copy); smaller ones are packed into one buffer to save collectives.
DIRECT_MIN_BYTES = 1 << 20


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _runs(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """[start, end) index runs of contiguous tensors lying back to back in one storage."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(tensors):
        if runs and t.is_contiguous() and _adjacent(tensors[i - 1], t):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.is_contiguous() and a.dtype == b.dtype and a.device == b.device
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr())


def _run_bytes(tensors: list[torch.Tensor], run: tuple[int, int]) -> int:
    return sum(tensors[i].numel() * tensors[i].element_size() for i in range(*run))


def _run_view(tensors: list[torch.Tensor], run: tuple[int, int]) -> torch.Tensor:
    """The bytes of a run as one uint8 tensor over the trainer's memory (one tensor: itself)."""
    first = tensors[run[0]]
    if run[1] - run[0] == 1:
        return _bytes(first)
    out = torch.empty(0, dtype=torch.uint8, device=first.device)
    out.set_(first.untyped_storage(), first.storage_offset() * first.element_size(), (_run_bytes(tensors, run),))
    return out


def _broadcast_all(pg: Any, bufs: list[torch.Tensor]) -> None:
    for b in bufs:
        pg.broadcast(b, 0).wait()


class BroadcastSender(BulkSender):
    tag = "broadcast"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.advertise = "127.0.0.1"
        self._store: Any = None
        self._pg: Any = None
        self._pending: asyncio.Future[Any] | None = None
        self._buf: torch.Tensor | None = None
        self._lay: Layout | None = None
        self._sends: list[torch.Tensor] = []
        self.device = torch.device("cpu")

    async def open(self, peers: list[str]) -> list[dict[str, Any]]:
        await self.close()
        from torch.distributed import TCPStore

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        world = len(peers) + 1
        timeout = datetime.timedelta(seconds=self.cfg.step_timeout_s)
        # Port 0: the OS picks a free one; its number is handed to the engines in their open info.
        self._store = TCPStore(self.advertise, 0, world, True, timeout=timeout, wait_for_workers=False)
        port = self._store.port
        self.peers = list(peers)
        infos = [{"backend": backend, "addr": self.advertise, "port": port, "rank": i + 1, "world": world,
                  "timeout_s": self.cfg.step_timeout_s} for i in range(len(peers))]
        # Rank 0 joins concurrently with the engines, who are told to join by the coordinator.
        loop = asyncio.get_running_loop()
        self._pending = loop.run_in_executor(None, self._join, backend, world, timeout)
        return infos

    def _join(self, backend: str, world: int, timeout: datetime.timedelta) -> None:
        self._pg = _make_pg(backend, self._store, 0, world, timeout)

    async def connected(self) -> None:
        """Await rank 0's join (after the engines were told to join)."""
        if self._pending is not None:
            fut, self._pending = self._pending, None
            try:
                await fut
            except RuntimeError as exc:
                raise SyncError(f"broadcast group setup failed: {exc}") from exc

    def prepare(self, version: int, seq: int, bucket: Bucket) -> dict[str, Any]:
        self._lay = Layout.of(bucket)
        runs = _runs(bucket.tensors)
        # Large runs go straight from the trainer's memory; only the small rest is packed.
        direct = [r for r in runs if _run_bytes(bucket.tensors, r) >= DIRECT_MIN_BYTES]
        packed = [i for r in runs if r not in direct for i in range(*r)]
        need = sum(bucket.tensors[i].numel() * bucket.tensors[i].element_size() for i in packed)
        if self._buf is None or self._buf.numel() < need:
            self._buf = torch.empty(max(self.bucket_bytes, need), dtype=torch.uint8, device=self.device)
        pos = 0
        for i in packed:
            b = _bytes(bucket.tensors[i])
            self._buf[pos:pos + b.numel()].copy_(b)
            pos += b.numel()
        self._sends = [_run_view(bucket.tensors, r) for r in direct]
        if packed:
            self._sends.append(self._buf[:pos])
        return {"layout": self._lay.to_wire(), "direct": [list(r) for r in direct], "packed": packed}

    async def transmit(self) -> None:
        await self.connected()
        if self._pg is None or self._lay is None:
            raise SyncError("broadcast: transmit before open/prepare")
        sends, self._sends = self._sends, []
        try:
            await asyncio.to_thread(_broadcast_all, self._pg, sends)
        except RuntimeError as exc:
            raise SyncError(f"broadcast of {self._lay.nbytes} bytes failed: {exc}") from exc

    async def close(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            await asyncio.gather(pending, return_exceptions=True)
        if self._pg is not None:
            await asyncio.to_thread(_shutdown, self._pg)
        self._pg = None
        self._store = None


class BroadcastReceiver(BulkReceiver):
    tag = "broadcast"

    def __init__(self, info: dict[str, Any], bucket_bytes: int) -> None:
        super().__init__(info, bucket_bytes)
        self._pg: Any = None
        self._store: Any = None
        dev = "cuda" if info.get("backend") == "nccl" else "cpu"
        self._buf = torch.empty(bucket_bytes, dtype=torch.uint8, device=dev)

    async def open(self) -> None:
        i = self.info
        try:
            self._store, self._pg = await asyncio.to_thread(
                _group, str(i["backend"]), str(i["addr"]), int(i["port"]), int(i["rank"]), int(i["world"]),
                float(i["timeout_s"]))
        except (KeyError, ValueError) as exc:
            raise SyncError(f"broadcast open info is malformed: {exc}") from exc
        except RuntimeError as exc:
            raise SyncError(f"joining the broadcast group failed: {exc}") from exc

    async def recv(self, header: dict[str, Any], local: LocalWeights) -> list[tuple[str, torch.Tensor]]:
        if self._pg is None:
            raise SyncError("broadcast: recv before open")
        lay = Layout.from_wire(header["layout"])
        try:
            direct = [(int(a), int(b)) for a, b in header["direct"]]
            packed = [int(i) for i in header["packed"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise SyncError(f"broadcast bucket header is malformed: {exc}") from exc
        if sorted([i for a, b in direct for i in range(a, b)] + packed) != list(range(len(lay.names))):
            raise SyncError(f"broadcast bucket header: direct runs {direct} and packed {packed} "
                            f"do not cover its {len(lay.names)} tensors once each")
        # Straight into the engine's staging slots when the bucket lies there contiguously
        # (no copy after the collective); else into the bucket buffer, copied when staged.
        region = slot_region(lay, local, self._buf.device)
        if region is None:
            if lay.nbytes > self._buf.numel():
                self._buf = torch.empty(lay.nbytes, dtype=torch.uint8, device=self._buf.device)
            region = self._buf[: lay.nbytes]
        ends = [*lay.offsets[1:], lay.nbytes]
        recvs = [region[lay.offsets[a]:ends[b - 1]] for a, b in direct]
        small = sum(ends[i] - lay.offsets[i] for i in packed)
        tmp = torch.empty(small, dtype=torch.uint8, device=region.device) if packed else None
        if tmp is not None:
            recvs.append(tmp)
        try:
            await asyncio.to_thread(_broadcast_all, self._pg, recvs)
        except RuntimeError as exc:
            raise SyncError(f"broadcast receive of {lay.nbytes} bytes failed: {exc}") from exc
        if tmp is not None:
            pos = 0
            for i in packed:
                n = ends[i] - lay.offsets[i]
                region[lay.offsets[i]:ends[i]].copy_(tmp[pos:pos + n])
                pos += n
        if region.data_ptr() != self._buf.data_ptr() and local.slot is not None:
            return [(n, local.slot(n)) for n in lay.names]
        return unpack(lay, self._buf)

    async def close(self) -> None:
        if self._pg is not None:
            await asyncio.to_thread(_shutdown, self._pg)
        self._pg = None
        self._store = None
