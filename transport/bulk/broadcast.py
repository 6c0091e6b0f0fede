"""`broadcast` channel: one torch.distributed group spanning the sending trainer ranks and every engine.

The group is standalone (its own TCPStore, not the trainer's default group), created
once per peer set and torn down explicitly; gloo on CPU, NCCL when the weights live on a
GPU. A gathered sync broadcasts each bucket from rank 0; a sharded one sends each rank's
buckets point to point (`BroadcastSender`). Blocking calls run in a worker thread or
complete through the work's future, so the actor loops stay responsive.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import torch

from miles.core.errors import SyncError
from miles.core.logging import get_logger
from miles.transport.bulk.base import BulkReceiver, LocalWeights, SenderPlace
from miles.transport.bulk.wire_plan import Landing, SegmentSender, flat_landed, flat_target

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


async def _broadcast_all(pg: Any, bufs: list[torch.Tensor]) -> None:
    """Broadcast `bufs` from rank 0, all issued at once, awaited without blocking the loop.

    Issuing is asynchronous for gloo and NCCL alike (the group's own worker runs them back to
    back), and completion comes back through the work's future: no thread hop per bucket.
    """
    if not bufs:
        return
    loop = asyncio.get_running_loop()
    works = [pg.broadcast(b, 0) for b in bufs]
    done = loop.create_future()

    def settle(err: BaseException | None) -> None:
        if not done.done():
            done.set_result(None) if err is None else done.set_exception(err)

    def finished(fut: Any) -> None:
        try:
            fut.value()
            err: BaseException | None = None
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            err = RuntimeError(str(exc))
        loop.call_soon_threadsafe(settle, err)

    works[-1].get_future().then(finished)  # the group completes its works in issue order
    await done
    for w in works:
        w.wait()  # already complete: surfaces an earlier work's failure


async def _wait(work: Any, what: str) -> None:
    try:
        await asyncio.to_thread(work.wait)
    except RuntimeError as exc:
        raise SyncError(f"{what} failed: {exc}") from exc


class BroadcastSender(SegmentSender):
    """One group of every sending trainer rank and every engine: trainer rank r is group rank r,
    engine #i is `world + i` (a gathered sync: rank 0 and engines 1..N); rank 0 hosts the store.

    A gathered bucket, and a bucket of a one-rank sharded sync (`fanout`), goes to every engine in
    one broadcast collective. A sharded bucket of several ranks goes by send/recv per (rank,
    engine) pair, not per-owner broadcasts: an engine lands buckets one
    at a time, in the order their headers arrive, and collectives of several owners' groups
    taken in different orders by different engines would deadlock; point-to-point transfers
    only need each pair's order, which the header order gives."""

    tag = "broadcast"
    sharded = True

    def __init__(self, cfg: Any, place: SenderPlace | None = None) -> None:
        super().__init__(cfg, place)
        self._store: Any = None
        self._pg: Any = None
        self._pending: asyncio.Future[Any] | None = None

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    async def setup(self, peers: list[str]) -> dict[str, Any]:
        """Rank 0: a fresh store for the group of every rank and `peers` (port 0: the OS picks one)."""
        await self.close()
        from torch.distributed import TCPStore

        timeout = datetime.timedelta(seconds=self.timeout_s)
        self._store = TCPStore(self.advertise, 0, self.world + len(peers), True, timeout=timeout,
                               wait_for_workers=False)
        return {"addr": self.advertise, "port": self._store.port, "backend": self.backend}

    async def open(self, peers: list[str], shared: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        if shared is None:  # a gathered sync: rank 0 sets the group up itself
            shared = await self.setup(peers)
        elif self.rank != 0:
            await self.close()
            from torch.distributed import TCPStore

            self._store = TCPStore(str(shared["addr"]), int(shared["port"]), self.world + len(peers), False,
                                   timeout=datetime.timedelta(seconds=self.timeout_s), wait_for_workers=False)
        self.peers = list(peers)
        size = self.world + len(peers)
        # This rank joins concurrently with the engines, who are told to join by the coordinator.
        self._pending = asyncio.ensure_future(asyncio.to_thread(
            _make_pg, str(shared["backend"]), self._store, self.rank, size, datetime.timedelta(seconds=self.timeout_s)))
        if self.rank != 0:
            return [{} for _ in peers]
        return [{"backend": shared["backend"], "addr": shared["addr"], "port": shared["port"], "rank": self.world + i,
                 "world": size, "timeout_s": self.timeout_s} for i in range(len(peers))]

    async def connected(self) -> None:
        """Await this rank's join (after the engines were told to join)."""
        if self._pending is not None:
            fut, self._pending = self._pending, None
            try:
                self._pg = await fut
            except RuntimeError as exc:
                raise SyncError(f"broadcast group setup failed on rank {self.rank}: {exc}") from exc

    async def transmit(self) -> None:
        await self.connected()
        if self._pg is None:
            raise SyncError("broadcast: transmit before open")
        plan = self.next_plan()
        try:
            await _broadcast_all(self._pg, plan.sends)
        except RuntimeError as exc:
            raise SyncError(f"broadcast of {plan.nbytes} bytes failed: {exc}") from exc

    @property
    def fanout(self) -> bool:
        """One sending rank (a gathered flat export as a one-rank sharded sync): its buckets reach
        every engine in one broadcast each, as the gathered channel's do (no per-owner deadlock)."""
        return self.world == 1

    def header(self, seq: int, data: torch.Tensor) -> dict[str, Any]:
        return {**super().header(seq, data), "collective": self.fanout}

    async def send_all(self, seq: int, data: torch.Tensor) -> None:
        await self.connected()
        if self._pg is None or not self.fanout:
            raise SyncError(f"broadcast (sharded): a broadcast to every engine needs one open sending rank "
                            f"(this is rank {self.rank} of {self.world})")
        try:
            await _broadcast_all(self._pg, [data])
        except RuntimeError as exc:
            raise SyncError(f"broadcast (sharded) of {data.numel()} bytes failed: {exc}") from exc

    async def send(self, peer: int, seq: int, data: torch.Tensor) -> None:
        await self.connected()
        if self._pg is None:
            raise SyncError("broadcast (sharded): send before open")
        work = self._pg.send([data], self.world + peer, seq)
        await _wait(work, f"broadcast (sharded): rank {self.rank} sending {data.numel()} bytes to engine #{peer}")

    async def close(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            await asyncio.gather(pending, return_exceptions=True)
        if self._pg is not None:
            await asyncio.to_thread(_shutdown, self._pg)
        self._pg = None
        self._store = None
        self._ready.clear()


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
        land = Landing("broadcast", header, local, self._buf)
        self._buf = land.buf
        try:
            await _broadcast_all(self._pg, land.recvs)
        except RuntimeError as exc:
            raise SyncError(f"broadcast receive of {land.lay.nbytes} bytes failed: {exc}") from exc
        return land.tensors()

    async def recv_flat(self, header: dict[str, Any], landing: Any, local: LocalWeights) -> list[str]:
        if self._pg is None:
            raise SyncError("broadcast: recv before open")
        lo, hi, dst, in_place, self._buf = flat_target("broadcast", header, landing, local, self._buf)
        try:
            await _broadcast_all(self._pg, [dst])
        except RuntimeError as exc:
            raise SyncError(f"broadcast receive of {hi - lo} bytes failed: {exc}") from exc
        return flat_landed(landing, lo, hi, dst, in_place, local)

    async def close(self) -> None:
        if self._pg is not None:
            await asyncio.to_thread(_shutdown, self._pg)
        self._pg = None
        self._store = None
