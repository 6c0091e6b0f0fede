"""`ucx` channel: UCXX endpoints from each trainer rank to each engine (the `ucx` extra).

Each sending rank (a gathered sync: rank 0 alone) listens; each engine connects to it once
per run and announces its index (a sharded sync's receiver: transport/bulk/shard_receiver.py), so
endpoints and the staging buffers (registered once, not per update) are reused for
every bucket. Large runs of tensors go from the trainer's memory, the rest packed
(wire_plan); receivers write straight into the engine's staging slots when they are laid
out like the bucket, else into their pre-allocated bucket buffer. Weights on a GPU stay
there end to end (UCX moves CUDA memory itself: cuda_ipc on one host, RDMA across).
UCXX is imported lazily: without it this channel raises a clear error.
"""

from __future__ import annotations

import asyncio
import atexit
import time
from collections.abc import Awaitable, Callable, Coroutine
from types import ModuleType
from typing import Any

import numpy as np
import torch

from miles.core.errors import SyncError
from miles.core.logging import get_logger
from miles.core.schema.sync import SyncConfig
from miles.transport.bulk.base import BulkReceiver, LocalWeights, SenderPlace
from miles.transport.bulk.buckets import Bucket
from miles.transport.bulk.wire_plan import (
    DIRECT_MIN_BYTES_GPU,
    Landing,
    SegmentSender,
    flat_landed,
    flat_target,
)

log = get_logger("miles.bulk.ucx")


def import_ucxx() -> ModuleType:
    try:
        import ucxx
    except ImportError as exc:
        raise SyncError("sync.transport='ucx' needs UCXX: pip install 'miles[ucx]' (ucxx-cu12, which "
                        f"pulls CUDA libraries: rmm, cuda-core); import failed: {exc}") from exc
    global _TEARDOWN
    if not _TEARDOWN:
        atexit.register(_teardown, ucxx)
        _TEARDOWN = True
    return ucxx


_TEARDOWN = False


def _teardown(ucxx: ModuleType) -> None:
    """Shut UCX down before the interpreter does: its worker threads, left running into
    interpreter teardown, abort the process ("terminate called without an active exception")."""
    try:
        ucxx.reset()
    except Exception as exc:  # noqa: BLE001 - endpoints left open: stop the threads we can
        log.warning("ucx_teardown_incomplete", error=str(exc)[:200])
        ucxx.stop_notifier_thread()


# Polling period cap while a UCX request is in flight (see `unspun`): far below a bucket's transfer time.
POLL_MAX_S = 1e-3


async def unspun(coro: Coroutine[Any, Any, Any]) -> Any:
    """Await a UCXX send/recv without busy-waiting.

    Without its notifier thread (off by default), UCXX waits for a request by re-polling it
    through `asyncio.sleep(0)` in a loop: each process with a transfer in flight keeps its
    event loop spinning, a whole core, while the bytes themselves are moved by UCX's progress
    thread. With several trainer ranks and engines on one host that spinning takes the CPU the
    transfers need (measured: ~0.8 s of CPU per idle second of a pending receive). This runs
    `coro` step by step and turns each of those bare yields into a short sleep, doubling from
    50 us up to POLL_MAX_S; a real future it waits on is awaited as a task would."""
    delay = 0.0
    value: Any = None
    error: BaseException | None = None
    try:
        while True:
            try:
                step = coro.throw(error) if error is not None else coro.send(value)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                if step is None:  # asyncio.sleep(0): the request is not complete yet
                    await asyncio.sleep(delay)
                    delay = min(max(2 * delay, 5e-5), POLL_MAX_S)
                else:  # a future: wait for it, then resume the coroutine (it reads the result itself)
                    step._asyncio_future_blocking = False
                    await asyncio.wait([step])
            except asyncio.CancelledError as exc:
                error = exc  # the coroutine unwinds itself, then the cancel goes on from it
    finally:
        coro.close()


def ucx_wait(coro: Coroutine[Any, Any, Any], buf: Any) -> Awaitable[Any]:
    """How to await a UCXX send/recv of `buf`: host memory through `unspun` (the CPU-bound case it
    was measured on); GPU memory with UCXX's own polling, as measured on the H200: a bucket there
    moves in milliseconds, which a sleep of up to POLL_MAX_S would lengthen, and GPU hosts have
    cores to spare for the spin."""
    return coro if isinstance(buf, torch.Tensor) and buf.is_cuda else unspun(coro)


async def ucx_transfer(op: Callable[[Any], Coroutine[Any, Any, Any]], buf: Any, timeout_s: float,
                       what: str) -> None:
    """`op(buf)` (an endpoint's send or recv of a `ucx_buffer`) awaited as `ucx_wait` says, within
    `timeout_s`; past it a SyncError "`what` did not complete within ...s"."""
    try:
        await asyncio.wait_for(ucx_wait(op(buf), buf), timeout_s)
    except TimeoutError:
        raise SyncError(f"{what} did not complete within {timeout_s}s") from None


def ucx_buffer(t: torch.Tensor) -> Any:
    """What UCXX sends from / receives into: a numpy view of host memory; CUDA tensors go as they
    are (they expose `__cuda_array_interface__`)."""
    return t.numpy() if t.device.type == "cpu" else t


class UcxPeers:
    """The sending side's UCX endpoints: a listener each engine connects to once, announcing its
    index first, and the endpoints by that index. Both the gathered sender (rank 0) and the
    sharded one (every rank) send over it."""

    def __init__(self) -> None:
        self.ucxx = import_ucxx()
        self._listener: Any = None
        self.eps: dict[int, Any] = {}

    async def _accept(self, ep: Any) -> None:
        who = np.empty(1, dtype=np.int64)
        await ep.recv(who)
        self.eps[int(who[0])] = ep

    async def listen(self) -> int:
        """A fresh listener (any earlier one and its endpoints closed); returns its port."""
        await self.close()
        self._listener = self.ucxx.create_listener(self._accept)
        return int(self._listener.port)

    async def connected(self, n: int, timeout_s: float, who: str) -> None:
        """Wait until `n` engines are connected; past `timeout_s` a SyncError naming `who`."""
        deadline = time.monotonic() + timeout_s
        while len(self.eps) < n:
            if time.monotonic() > deadline:
                raise SyncError(f"{who}: {len(self.eps)}/{n} engines connected within {timeout_s}s")
            await asyncio.sleep(0.005)

    async def send(self, index: int, buf: Any, timeout_s: float, what: str) -> None:
        """`buf` (a `ucx_buffer`) to engine #`index`, as `ucx_transfer` awaits it."""
        await ucx_transfer(self.eps[index].send, buf, timeout_s, what)

    async def close(self) -> None:
        for ep in self.eps.values():
            await ep.close()
        self.eps = {}
        if self._listener is not None:
            self._listener.close()
            self._listener = None


class UcxSender(SegmentSender):
    """This rank's listener and an endpoint per engine. Gathered buckets go as segments
    (wire_plan); a sharded bucket is one message to each engine."""

    tag = "ucx"
    sharded = True
    direct_min = DIRECT_MIN_BYTES_GPU  # a UCX message costs a rendezvous round trip: pack all but huge runs

    def __init__(self, cfg: SyncConfig, place: SenderPlace | None = None) -> None:
        super().__init__(cfg, place)
        self._peers = UcxPeers()

    async def open(self, peers: list[str], shared: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        port = await self._peers.listen()
        self.peers = list(peers)
        return [{"addr": self.advertise, "port": port, "index": i, "mem": self.device.type,
                 "timeout_s": self.timeout_s} for i in range(len(peers))]

    async def connected(self) -> None:
        await self._peers.connected(len(self.peers), self.timeout_s, f"ucx (rank {self.rank})")

    def prepare(self, version: int, seq: int, bucket: Bucket) -> dict[str, Any]:
        header = super().prepare(version, seq, bucket)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # UCX reads the bytes outside torch's streams
        return header

    def prepare_flat(self, version: int, seq: int, lo: int, hi: int, weights: Any) -> dict[str, Any]:
        header = super().prepare_flat(version, seq, lo, hi, weights)
        if weights.buffer.device.type == "cuda":
            torch.cuda.current_stream(weights.buffer.device).synchronize()
        return header

    async def transmit(self) -> None:
        await self.connected()
        plan = self.next_plan()
        views = [ucx_buffer(b) for b in plan.sends]

        async def to(index: int) -> None:
            for v in views:  # in header order: the receiver posts its receives in the same order
                await self._peers.send(index, v, self.timeout_s,
                                       f"ucx: sending {plan.nbytes} bytes to engine #{index} ({self.peers[index]!r})")

        await asyncio.gather(*(to(i) for i in list(self._peers.eps)))

    async def send(self, peer: int, seq: int, data: torch.Tensor) -> None:
        if data.device.type == "cuda":
            torch.cuda.current_stream(data.device).synchronize()  # UCX reads outside torch's streams
        await self._peers.send(peer, ucx_buffer(data), self.timeout_s,
                               f"ucx (rank {self.rank}): sending {data.numel()} bytes to engine #{peer} "
                               f"({self.peers[peer]!r})")

    async def close(self) -> None:
        await self._peers.close()
        self._ready.clear()


class UcxReceiver(BulkReceiver):
    tag = "ucx"

    def __init__(self, info: dict[str, Any], bucket_bytes: int) -> None:
        super().__init__(info, bucket_bytes)
        self.ucxx = import_ucxx()
        # GPU weights travel GPU to GPU (UCX picks cuda_ipc / RDMA); host ones through host memory.
        dev = torch.device("cuda", torch.cuda.current_device()) if info.get("mem") == "cuda" else torch.device("cpu")
        self._buf = torch.empty(bucket_bytes, dtype=torch.uint8, device=dev)
        self._ep: Any = None

    async def open(self) -> None:
        try:
            addr, port, index = str(self.info["addr"]), int(self.info["port"]), int(self.info["index"])
        except (KeyError, ValueError) as exc:
            raise SyncError(f"ucx open info is malformed: {exc}") from exc
        self._ep = await self.ucxx.create_endpoint(addr, port)
        await self._ep.send(np.array([index], dtype=np.int64))

    async def recv(self, header: dict[str, Any], local: LocalWeights) -> list[tuple[str, torch.Tensor]]:
        if self._ep is None:
            raise SyncError("ucx: recv before open")
        land = Landing("ucx", header, local, self._buf)
        self._buf = land.buf
        timeout = float(self.info.get("timeout_s", 120.0))
        for r in land.recvs:
            await ucx_transfer(self._ep.recv, ucx_buffer(r), timeout,
                               f"ucx: receiving {r.numel()} bytes from the trainer")
        return land.tensors()

    async def recv_flat(self, header: dict[str, Any], landing: Any, local: LocalWeights) -> list[str]:
        if self._ep is None:
            raise SyncError("ucx: recv before open")
        lo, hi, dst, in_place, self._buf = flat_target("ucx", header, landing, local, self._buf)
        timeout = float(self.info.get("timeout_s", 120.0))
        await ucx_transfer(self._ep.recv, ucx_buffer(dst), timeout, f"ucx: receiving {hi - lo} bytes from the trainer")
        return flat_landed(landing, lo, hi, dst, in_place, local)

    async def close(self) -> None:
        if self._ep is not None:
            await self._ep.close()
            self._ep = None
