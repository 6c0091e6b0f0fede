"""`broadcast` channel: one torch.distributed group spanning the sending trainer ranks and every engine.

The group is standalone (its own TCPStore, not the trainer's default group), created
once per peer set and torn down explicitly; gloo on CPU, NCCL when the weights live on a
GPU. A gathered sync broadcasts each bucket from rank 0; a sharded one sends each rank's
buckets point to point (`BroadcastSender`). Blocking calls run in a worker thread or
complete through the work's future, so the actor loops stay responsive.

Under NCCL every member first checks that no two members share a GPU (transport/bulk/
nccl_devices.py), then makes the communicator in its joining thread: left to the first
collective, NCCL's init ran inside that call's issue, on the event loop, where a member that
never came (or a GPU two members share) blocked the loop for ever. Every wait on the group
(join, broadcast, send/recv) is bounded by the sync step timeout (`sync.step_timeout_s`).
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import torch

from miles.core.errors import SyncError
from miles.core.logging import get_logger
from miles.transport.bulk.base import BulkReceiver, LocalWeights, SenderPlace
from miles.transport.bulk.nccl_devices import MemberDevice, agree_devices
from miles.transport.bulk.wire_plan import Landing, SegmentSender, flat_landed, flat_target

log = get_logger("miles.bulk.broadcast")


def member_device(backend: str, rank: int, who: str, device: torch.device) -> MemberDevice | None:
    """The device a member checks in with before the group is made: its GPU under NCCL; none under
    gloo (CPU members may share a CPU freely). Called on the event loop's thread, where the member
    set its CUDA device, not in the join's worker thread: the current CUDA device is per thread."""
    return MemberDevice.of(rank, who, device) if backend == "nccl" else None


def _join_bound(timeout_s: float) -> float:
    """How long a member waits for its join: the store may wait `timeout_s` twice (every member's
    device, then NCCL's id), and NCCL's own init has no deadline of its own."""
    return 2 * timeout_s


def _group(backend: str, addr: str, port: int, rank: int, world: int, timeout_s: float,
           device: MemberDevice | None = None) -> tuple[Any, Any]:
    from torch.distributed import TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(addr, port, world, False, timeout=timeout, wait_for_workers=False)
    return store, _make_pg(backend, store, rank, world, timeout, device)


def _make_pg(backend: str, store: Any, rank: int, world: int, timeout: datetime.timedelta,
             device: MemberDevice | None = None) -> Any:
    """This member's process group. With `device` (see `member_device`), every member's device is
    agreed on first (SyncError on every member when two share a GPU), and under NCCL the
    communicator is made here, on the joining thread."""
    if device is not None:
        agree_devices(store, device, world)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = ProcessGroupNCCL(store, rank, world, opts)
        if device is not None:
            pg.eager_connect_single_device(torch.device("cuda", device.index))
        return pg
    from torch.distributed import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, world, timeout)


def _shutdown(pg: Any) -> None:
    try:
        pg.shutdown()
    except RuntimeError as exc:  # a peer already gone: the group is dead either way
        log.warning("broadcast_group_shutdown_failed", error=str(exc))


async def _broadcast_all(pg: Any, bufs: list[torch.Tensor], timeout_s: float | None = None,
                         what: str = "broadcast") -> None:
    """Broadcast `bufs` from rank 0, all issued at once, awaited without blocking the loop.

    Issuing is asynchronous for gloo and NCCL alike (the group's own worker runs them back to
    back), and completion comes back through the work's future: no thread hop per bucket.
    `timeout_s` bounds the wait: gloo fails a transfer to a member that never takes part after
    the group's timeout, but an NCCL kernel waits for it for ever (only its watchdog, if any,
    ends it), so a dead engine would hang the caller. `what` names the transfer in that error.
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
        try:
            loop.call_soon_threadsafe(settle, err)
        except RuntimeError:  # the loop closed after the wait gave up: nobody awaits this any more
            pass

    works[-1].get_future().then(finished)  # the group completes its works in issue order
    try:
        await asyncio.wait_for(asyncio.shield(done), timeout_s)
    except TimeoutError:
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # a late failure is not "never retrieved"
        raise SyncError(f"{what} did not complete within {timeout_s:g}s (sync.step_timeout_s): a member of "
                        "the group never took part (an engine or trainer rank that died, left or is stuck); "
                        "the channel is reopened at the next push") from None
    for w in works:
        w.wait()  # already complete: surfaces an earlier work's failure


async def _wait(work: Any, what: str, timeout_s: float | None = None) -> None:
    """Wait for one send/recv in a worker thread, bounded by `timeout_s` (see `_broadcast_all`)."""
    try:
        await asyncio.wait_for(asyncio.to_thread(work.wait), timeout_s)
    except TimeoutError:
        raise SyncError(f"{what} did not complete within {timeout_s:g}s (sync.step_timeout_s): its peer never "
                        "took part") from None
    except RuntimeError as exc:
        raise SyncError(f"{what} failed: {exc}") from exc


async def _joined(fut: Any, timeout_s: float, who: str) -> Any:
    """A member's join (a worker thread making its group), bounded; SyncError names the member."""
    try:
        return await asyncio.wait_for(fut, _join_bound(timeout_s))
    except TimeoutError:
        raise SyncError(f"broadcast group: {who} did not join within {_join_bound(timeout_s):g}s (twice "
                        "sync.step_timeout_s): a member never came") from None


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
        self._version = -1  # of the bucket being sent, for the errors

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
        backend = str(shared["backend"])
        me = member_device(backend, self.rank, f"trainer rank {self.rank}", self.device)
        # This rank joins concurrently with the engines, who are told to join by the coordinator.
        self._pending = asyncio.ensure_future(asyncio.to_thread(
            _make_pg, backend, self._store, self.rank, size, datetime.timedelta(seconds=self.timeout_s), me))
        if self.rank != 0:
            return [{} for _ in peers]
        return [{"backend": backend, "addr": shared["addr"], "port": shared["port"], "rank": self.world + i,
                 "world": size, "timeout_s": self.timeout_s, "member": peer} for i, peer in enumerate(peers)]

    async def connected(self) -> None:
        """Await this rank's join (after the engines were told to join)."""
        if self._pending is not None:
            fut, self._pending = self._pending, None
            try:
                self._pg = await _joined(fut, self.timeout_s, f"trainer rank {self.rank}")
            except RuntimeError as exc:
                raise SyncError(f"broadcast group setup failed on rank {self.rank}: {exc}") from exc

    def prepare(self, version: int, seq: int, bucket: Any) -> dict[str, Any]:
        self._version = version
        return super().prepare(version, seq, bucket)

    def prepare_flat(self, version: int, seq: int, lo: int, hi: int, weights: Any) -> dict[str, Any]:
        self._version = version
        return super().prepare_flat(version, seq, lo, hi, weights)

    async def transmit(self) -> None:
        await self.connected()
        if self._pg is None:
            raise SyncError("broadcast: transmit before open")
        plan = self.next_plan()
        what = f"broadcast of v{self._version} ({plan.nbytes} bytes)"
        try:
            await _broadcast_all(self._pg, plan.sends, self.timeout_s, what)
        except RuntimeError as exc:
            raise SyncError(f"{what} failed: {exc}") from exc

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
        what = f"broadcast (sharded) of bucket {seq} ({data.numel()} bytes)"
        try:
            await _broadcast_all(self._pg, [data], self.timeout_s, what)
        except RuntimeError as exc:
            raise SyncError(f"{what} failed: {exc}") from exc

    async def send(self, peer: int, seq: int, data: torch.Tensor) -> None:
        await self.connected()
        if self._pg is None:
            raise SyncError("broadcast (sharded): send before open")
        work = self._pg.send([data], self.world + peer, seq)
        await _wait(work, f"broadcast (sharded): rank {self.rank} sending bucket {seq} ({data.numel()} bytes) to "
                          f"engine #{peer}", self.timeout_s)

    async def close(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:  # a join still running: let it end (bounded: NCCL's init may not), unread
            await asyncio.wait([pending], timeout=_join_bound(self.timeout_s))
            if pending.done() and not pending.cancelled():
                pending.exception()
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
            rank, timeout_s, backend = int(i["rank"]), float(i["timeout_s"]), str(i["backend"])
            who = f"engine {i.get('member', f'#{rank}')!r}"
            me = member_device(backend, rank, who, self._buf.device)
            self._store, self._pg = await _joined(asyncio.to_thread(
                _group, backend, str(i["addr"]), int(i["port"]), rank, int(i["world"]), timeout_s, me), timeout_s, who)
        except (KeyError, ValueError) as exc:
            raise SyncError(f"broadcast open info is malformed: {exc}") from exc
        except RuntimeError as exc:
            raise SyncError(f"joining the broadcast group failed: {exc}") from exc

    async def recv(self, header: dict[str, Any], local: LocalWeights) -> list[tuple[str, torch.Tensor]]:
        if self._pg is None:
            raise SyncError("broadcast: recv before open")
        land = Landing("broadcast", header, local, self._buf)
        self._buf = land.buf
        what = f"broadcast receive of {land.lay.nbytes} bytes"
        try:
            await _broadcast_all(self._pg, land.recvs, float(self.info["timeout_s"]), what)
        except RuntimeError as exc:
            raise SyncError(f"{what} failed: {exc}") from exc
        return land.tensors()

    async def recv_flat(self, header: dict[str, Any], landing: Any, local: LocalWeights) -> list[str]:
        if self._pg is None:
            raise SyncError("broadcast: recv before open")
        lo, hi, dst, in_place, self._buf = flat_target("broadcast", header, landing, local, self._buf)
        what = f"broadcast receive of {hi - lo} bytes"
        try:
            await _broadcast_all(self._pg, [dst], float(self.info["timeout_s"]), what)
        except RuntimeError as exc:
            raise SyncError(f"{what} failed: {exc}") from exc
        return flat_landed(landing, lo, hi, dst, in_place, local)

    async def close(self) -> None:
        if self._pg is not None:
            await asyncio.to_thread(_shutdown, self._pg)
        self._pg = None
        self._store = None
