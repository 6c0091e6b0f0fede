"""ZeroMQ helpers: contexts, bind/connect on tcp:// and ipc://, socket options (CurveZMQ: curve.py)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Literal

import zmq
import zmq.asyncio

from miles.core.errors import PeerTimeout, Stopping, TransportError

_ipc_dir: str | None = None


def async_context() -> zmq.asyncio.Context:
    return zmq.asyncio.Context.instance()


def apply_options(sock: zmq.Socket, hwm: int = 10000, linger_ms: int = 0, max_msg_bytes: int = -1,
                  rcvhwm: int = 0) -> None:
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, rcvhwm or hwm)
    sock.setsockopt(zmq.LINGER, linger_ms)
    if max_msg_bytes > 0:
        # ZeroMQ drops the connection of a peer announcing a larger frame before allocating it,
        # so a huge frame is never received in full only to be refused by the codec afterwards.
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    if sock.type in (zmq.DEALER, zmq.ROUTER, zmq.SUB, zmq.PUB):
        # Keepalive so half-open TCP connections to a dead node are noticed by the OS.
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 5)


def ipc_path(name: str, base: str = "") -> str:
    global _ipc_dir
    if base:
        Path(base).mkdir(parents=True, exist_ok=True)
        d = base
    else:
        if _ipc_dir is None:
            _ipc_dir = tempfile.mkdtemp(prefix="miles-ipc-")
        d = _ipc_dir
    return f"ipc://{os.path.join(d, name)}"


def bind(sock: zmq.Socket, scheme: Literal["tcp", "ipc"] = "tcp", interface: str = "127.0.0.1", name: str = "",
         ipc_dir: str = "", port: int = 0) -> str:
    """Bind to a fresh address (random free port for tcp) and return the connectable address."""
    try:
        if scheme == "ipc":
            addr = ipc_path(f"{name or 'sock'}-{os.getpid()}-{os.urandom(4).hex()}", ipc_dir)
            sock.bind(addr)
            return addr
        if port:
            sock.bind(f"tcp://{interface}:{port}")
            return f"tcp://{interface}:{port}"
        p = sock.bind_to_random_port(f"tcp://{interface}")
        return f"tcp://{interface}:{p}"
    except zmq.ZMQError as exc:
        raise TransportError(
            f"cannot bind {scheme} socket on {interface}:{port or 'random'}: {exc}"
            + (" (port in use: choose another port or stop the other process)" if exc.errno == zmq.EADDRINUSE else "")
        ) from exc


def socket(kind: int, ctx: Any = None, hwm: int = 10000, linger_ms: int = 0) -> Any:
    s = (ctx or async_context()).socket(kind)
    apply_options(s, hwm, linger_ms)
    return s


class LoopSocket:
    """A ZeroMQ socket driven by the event loop's FD reader, with non-blocking fast-path sends.

    Incoming messages are handed to `on_frames` straight from the FD callback (no task
    hop, no future per message). Sends go through `zmq.NOBLOCK` at once and back off
    briefly only under backpressure. ZeroMQ's FD is edge-triggered and a send can
    consume the edge of an arrival, so every wake-up and every send drains until
    EVENTS shows no input: no message is ever left unnoticed.
    """

    def __init__(self, sock: Any, on_frames: Any) -> None:
        self.sync = sock
        self.on_frames = on_frames
        self.loop: Any = None
        self.fd = sock.getsockopt(zmq.FD)
        self._closed = False

    def start(self, loop: Any) -> None:
        self.loop = loop
        loop.add_reader(self.fd, self.drain)
        loop.call_soon(self.drain)

    def drain(self) -> None:
        s = self.sync
        while not self._closed and s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self.on_frames(s.recv_multipart(zmq.NOBLOCK, copy=False))

    async def send(self, frames: list[Any], deadline: float | None = None, what: str = "") -> None:
        """Send at once, or wait out backpressure until `deadline` (time.monotonic) and raise PeerTimeout."""
        import asyncio
        import time

        delay = 0.0001
        while True:
            if self._closed:  # this process is stopping (host.stop closed its sockets): not a raw ENOTSOCK
                raise Stopping(f"send {what or 'message'}: the socket is closed; this process is stopping")
            try:
                self.sync.send_multipart(frames, zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                # Backpressure (HWM reached): back off briefly, up to 5 ms between tries.
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise PeerTimeout(
                            f"send {what or 'message'} refused by backpressure: the peer's queue "
                            "stayed full until the deadline") from None
                    await asyncio.sleep(min(delay, left))
                else:
                    await asyncio.sleep(delay)
                delay = min(delay * 2, 0.005)
        if self.sync.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self.loop.call_soon(self.drain)

    def close(self) -> None:
        self._closed = True
        if self.loop is not None:
            self.loop.remove_reader(self.fd)
        self.sync.close(0)


class QueuedLoopSocket(LoopSocket):
    """A `LoopSocket` whose arrivals queue up for one consumer task (`recv_batch` then `done`).

    At most `capacity` messages are read off the socket and not yet handled (queued plus
    the batch in hand). At the bound, reading stops: ZeroMQ's receive high-water mark
    then fills, then TCP's window, and the senders' sends block (until their deadlines).
    """

    def __init__(self, sock: Any, capacity: int = 1024) -> None:
        import asyncio
        from collections import deque

        super().__init__(sock, self._arrived)
        self.capacity = max(1, capacity)
        self._queue: deque[list[Any]] = deque()
        self._held = 0  # the batch handed out by recv_batch and not yet reported done
        self._event = asyncio.Event()

    def drain(self) -> None:
        s = self.sync
        while (not self._closed and len(self._queue) + self._held < self.capacity
               and s.getsockopt(zmq.EVENTS) & zmq.POLLIN):
            self._arrived(s.recv_multipart(zmq.NOBLOCK, copy=False))

    def _arrived(self, frames: list[Any]) -> None:
        self._queue.append(frames)
        self._event.set()

    async def recv_batch(self) -> list[list[Any]]:
        while not self._queue:
            self._event.clear()
            await self._event.wait()
        out = list(self._queue)
        self._queue.clear()
        self._held = len(out)
        return out

    def done(self) -> None:
        """The last batch is handled: read on (the edge-triggered FD will not wake us for old input)."""
        self._held = 0
        if not self._closed and self.loop is not None:
            self.drain()
