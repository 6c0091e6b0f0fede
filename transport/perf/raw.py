"""Raw baselines: the bare library each transport is built on, moving the same bytes.

  zmq-ctl   sync pyzmq PAIR, bytes payloads (copied, as small control messages are)
  zmq-bulk  sync pyzmq PAIR, zero-copy frames
  broadcast a bare torch.distributed ProcessGroup (gloo on CPU, NCCL on GPU), 2 ranks
  ucx       bare UCXX endpoint send/recv
  disk      write + atomic rename of one file per message, read back by the peer
  cuda-ipc  one CUDA IPC-mapped buffer: copy in, peer copies out
Acks are one tiny message back on the same library (pyzmq for disk and cuda-ipc, whose
data path has no messages). Rank 0 (the driver) listens; rank 1 connects.
"""

from __future__ import annotations

import asyncio
import datetime
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zmq

from miles.core.errors import PeerTimeout, TransportError

_IPC_KEYS = ("device", "handle", "size", "offset", "ref_handle", "ref_offset", "event", "event_sync")


@dataclass
class Ctx:
    """What both ends know about a run (sent from rank 0 in the open message)."""

    device: str
    max_size: int
    timeout_s: float
    bind_host: str = "127.0.0.1"  # where rank 0 listens (loopback unless the launcher says otherwise)
    peer_host: str = "127.0.0.1"  # where rank 1 reaches rank 0
    directory: str = ""  # shared directory (disk)

    @property
    def dev(self) -> torch.device:
        return torch.device("cpu" if self.device == "pinned" else self.device)

    @property
    def pinned(self) -> bool:
        """Host buffers in page-locked memory (what a GPU copies from at full speed)."""
        return self.device == "pinned"


def payload(ctx: Ctx) -> torch.Tensor:
    t = torch.full((ctx.max_size,), 7, dtype=torch.uint8, device=ctx.dev)
    return t.pin_memory() if ctx.pinned else t


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _Pair:
    """A blocking PAIR socket with a receive deadline (the raw pyzmq path)."""

    def __init__(self, ctx: Ctx, info: dict[str, Any] | None = None) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, int(ctx.timeout_s * 1000))
        self.timeout_s = ctx.timeout_s
        if info is None:
            self.port: int = self.sock.bind_to_random_port(f"tcp://{ctx.bind_host}")
        else:
            self.port = int(info["zmq_port"])
            self.sock.connect(f"tcp://{ctx.peer_host}:{self.port}")

    def recv(self) -> Any:
        try:
            return self.sock.recv(copy=False)
        except zmq.Again:
            raise PeerTimeout(f"raw pyzmq: nothing from the peer within {self.timeout_s:g} s") from None

    def close(self) -> None:
        self.sock.close(0)


class _PairAck:
    """Ack and close over the control pair, shared by the raw baselines that own one."""

    pair: _Pair | None
    responder: bool

    async def ack(self) -> None:
        assert self.pair is not None
        if self.responder:
            self.pair.sock.send(b"a")
        else:
            self.pair.recv()

    async def close(self) -> None:
        if self.pair is not None:
            self.pair.close()
            self.pair = None


class RawZmq(_PairAck):
    """Both ends of the pyzmq baseline (`copy` False for zmq-bulk's zero-copy frames)."""

    def __init__(self, copy: bool) -> None:
        self.copy = copy
        self.pair: _Pair | None = None
        self.buf: Any = None

    async def open(self, ctx: Ctx, info: dict[str, Any] | None = None) -> dict[str, Any]:
        self.pair = _Pair(ctx, info)
        self.responder = info is not None
        self.buf = payload(ctx).numpy()
        self._bytes: dict[int, bytes] = {}
        return {"zmq_port": self.pair.port}

    async def connect(self) -> None:
        """Nothing to wait for: zmq connects in the background."""

    async def send(self, size: int) -> None:
        assert self.pair is not None
        if self.copy:
            b = self._bytes.get(size)
            if b is None:
                self._bytes = {size: bytes(self.buf[:size])}
                b = self._bytes[size]
            self.pair.sock.send(b)
        else:
            self.pair.sock.send(self.buf[:size], copy=False)

    async def recv(self, size: int) -> None:
        assert self.pair is not None
        f = self.pair.recv()
        if len(f) != size:
            raise TransportError(f"raw pyzmq: expected {size} bytes, got {len(f)}")


class RawDist:
    """Two-rank torch.distributed group; data broadcast from rank 0, ack from rank 1."""

    def __init__(self) -> None:
        self.pg: Any = None
        self.store: Any = None
        self.rank = 0

    async def open(self, ctx: Ctx, info: dict[str, Any] | None = None) -> dict[str, Any]:
        from torch.distributed import TCPStore

        self.ctx = ctx
        self.buf = payload(ctx)
        self.one = torch.ones(1, dtype=torch.uint8, device=ctx.dev)
        timeout = datetime.timedelta(seconds=ctx.timeout_s)
        if info is None:
            self.store = TCPStore(ctx.peer_host, 0, 2, True, timeout=timeout, wait_for_workers=False)
            return {"port": self.store.port}
        self.rank = 1
        self._port = int(info["port"])
        await self.connect()
        return {}

    async def connect(self) -> None:
        from miles.transport.bulk.broadcast import _make_pg

        timeout = datetime.timedelta(seconds=self.ctx.timeout_s)
        backend = "nccl" if self.ctx.dev.type == "cuda" else "gloo"

        def join() -> Any:
            from torch.distributed import TCPStore

            if self.store is None:
                self.store = TCPStore(self.ctx.peer_host, self._port, 2, False, timeout=timeout)
            return _make_pg(backend, self.store, self.rank, 2, timeout)

        try:
            self.pg = await asyncio.to_thread(join)
        except RuntimeError as exc:
            raise TransportError(f"raw torch.distributed ({backend}) group setup failed: {exc}") from exc
        # First collective outside the measurement: NCCL sets its communicator up lazily.
        self.pg.broadcast(self.one, 0).wait()
        sync(self.ctx.dev)

    async def send(self, size: int) -> None:
        self.pg.broadcast(self.buf[:size], 0).wait()

    recv = send

    async def ack(self) -> None:
        self.pg.broadcast(self.one, 1).wait()
        sync(self.ctx.dev)

    async def close(self) -> None:
        if self.pg is not None:
            try:
                self.pg.shutdown()
            except RuntimeError:
                pass  # the peer already left: the group is gone either way
        self.pg = None
        self.store = None


class RawUcx:
    """Bare UCXX: rank 0 listens, rank 1 connects; tagless ordered send/recv per endpoint."""

    def __init__(self) -> None:
        from miles.transport.bulk.ucx import import_ucxx, ucx_buffer

        self.ucxx = import_ucxx()
        self._arr = ucx_buffer
        self.ep: Any = None
        self.listener: Any = None

    async def open(self, ctx: Ctx, info: dict[str, Any] | None = None) -> dict[str, Any]:
        self.ctx = ctx
        self.buf = payload(ctx)
        self.one = torch.ones(1, dtype=torch.uint8, device=ctx.dev)
        self._views: dict[int, Any] = {}
        if info is None:
            async def accept(ep: Any) -> None:
                self.ep = ep

            self.listener = self.ucxx.create_listener(accept)
            return {"port": self.listener.port}
        self.ep = await self.ucxx.create_endpoint(ctx.peer_host, int(info["port"]))
        return {}

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + self.ctx.timeout_s
        while self.ep is None:
            if loop.time() > end:
                raise PeerTimeout(f"raw ucxx: the peer did not connect within {self.ctx.timeout_s:g} s")
            await asyncio.sleep(0.002)

    def _view(self, size: int) -> Any:
        v = self._views.get(size)
        if v is None:
            v = self._views[size] = self._arr(self.buf[:size])
        return v

    async def send(self, size: int) -> None:
        await self.ep.send(self._view(size))

    async def recv(self, size: int) -> None:
        await asyncio.wait_for(self.ep.recv(self._view(size)), self.ctx.timeout_s)

    async def ack(self) -> None:
        if self.listener is None:
            await self.ep.send(self._arr(self.one))
        else:
            await asyncio.wait_for(self.ep.recv(self._arr(self.one)), self.ctx.timeout_s)
        sync(self.ctx.dev)

    async def close(self) -> None:
        if self.ep is not None:
            await self.ep.close()
            self.ep = None
        if self.listener is not None:
            self.listener.close()
            self.listener = None


class RawDisk(_PairAck):
    """One file per message in a shared directory: write, rename, peer reads and deletes it."""

    def __init__(self) -> None:
        self.pair: _Pair | None = None
        self.seq = 0

    async def open(self, ctx: Ctx, info: dict[str, Any] | None = None) -> dict[str, Any]:
        if not ctx.directory:
            raise TransportError("disk transport needs a shared directory (--dir)")
        self.root = Path(ctx.directory) / "raw"
        self.root.mkdir(parents=True, exist_ok=True)
        self.buf = payload(ctx).numpy().data
        self.pair = _Pair(ctx, info)
        self.responder = info is not None
        return {"zmq_port": self.pair.port}

    async def connect(self) -> None:
        """The directory needs no connection."""

    async def send(self, size: int) -> None:
        assert self.pair is not None
        self.seq += 1
        final = self.root / f"m{self.seq}.bin"
        tmp = final.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(self.buf[:size])
        os.replace(tmp, final)
        self.pair.sock.send(final.name.encode())

    async def recv(self, size: int) -> None:
        assert self.pair is not None
        path = self.root / self.pair.recv().bytes.decode()
        with open(path, "rb") as f:
            n = f.readinto(self.buf[:size])
        path.unlink()
        if n != size:
            raise TransportError(f"raw disk: {path.name} holds {n} bytes, expected {size}")


class RawCudaIpc(_PairAck):
    """One device buffer shared by CUDA IPC: rank 0 copies in, rank 1 copies out, per message."""

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise TransportError("cuda-ipc needs CUDA; none is available in this process")
        self.pair: _Pair | None = None

    async def open(self, ctx: Ctx, info: dict[str, Any] | None = None) -> dict[str, Any]:
        self.dev = ctx.dev
        self.local = payload(ctx)
        self.pair = _Pair(ctx, info)
        self.responder = info is not None
        if info is None:
            self.shared = torch.empty(ctx.max_size, dtype=torch.uint8, device=ctx.dev)
            fields = self.shared.untyped_storage()._share_cuda_()
            return {"zmq_port": self.pair.port, "ipc": dict(zip(_IPC_KEYS, fields, strict=True))}
        storage = torch.UntypedStorage._new_shared_cuda(*(info["ipc"][k] for k in _IPC_KEYS))
        self.shared = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        return {}

    async def connect(self) -> None:
        """The mapping is made by the responder's open."""

    async def send(self, size: int) -> None:
        assert self.pair is not None
        self.shared[:size].copy_(self.local[:size])
        torch.cuda.synchronize(self.dev)
        self.pair.sock.send(b"m")

    async def recv(self, size: int) -> None:
        assert self.pair is not None
        self.pair.recv()
        self.local[:size].copy_(self.shared[:size])
        torch.cuda.synchronize(self.local.device)


def make_raw(transport: str) -> Any:
    if transport == "zmq-ctl":
        return RawZmq(copy=True)
    if transport == "zmq-bulk":
        return RawZmq(copy=False)
    if transport == "broadcast":
        return RawDist()
    if transport == "ucx":
        return RawUcx()
    if transport == "disk":
        return RawDisk()
    if transport == "cuda-ipc":
        return RawCudaIpc()
    raise TransportError(f"no raw baseline for transport {transport!r}")
