"""The control link between the two ends of a perftest: one ZeroMQ PAIR socket, msgpack dicts.

Rank 0 listens and drives; rank 1 connects, says hello, and does what rank 0 asks.
Every wait has a deadline and fails with `PeerTimeout` naming what was awaited;
a peer that reports an error fails with `TransportError` carrying its message.
"""

from __future__ import annotations

import asyncio
import socket as pysocket
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from miles.core.errors import PeerGone, PeerTimeout, TransportError


def route_ip(peer_host: str, port: int) -> str:
    """The local IP this host reaches `peer_host` from (what a listener here should advertise)."""
    try:
        with pysocket.socket(pysocket.AF_INET, pysocket.SOCK_DGRAM) as s:
            s.connect((peer_host, port or 9))  # UDP connect: picks the route, sends nothing
            return str(s.getsockname()[0])
    except OSError as exc:
        raise TransportError(f"cannot route to peer host {peer_host!r}: {exc}") from exc


class Control:
    def __init__(self, sock: zmq.asyncio.Socket, where: str) -> None:
        self.sock = sock
        self.where = where
        self.peer_alive: Callable[[], bool] | None = None  # set for a local child: fail fast when it dies

    @classmethod
    def bind(cls, host: str, port: int) -> tuple[Control, int]:
        sock = zmq.asyncio.Context.instance().socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            if port:
                sock.bind(f"tcp://{host}:{port}")
            else:
                port = sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            sock.close(0)
            raise TransportError(f"perftest: cannot listen on {host}:{port}: {exc}") from exc
        return cls(sock, f"{host}:{port}"), port

    @classmethod
    def connect(cls, host: str, port: int) -> Control:
        sock = zmq.asyncio.Context.instance().socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{port}")
        return cls(sock, f"{host}:{port}")

    async def send(self, op: str, timeout_s: float = 30.0, **fields: Any) -> None:
        """Send one message; a PAIR socket holds it until the peer is connected, hence the deadline."""
        try:
            await asyncio.wait_for(self.sock.send(msgpack.packb({"op": op, **fields}, use_bin_type=True)), timeout_s)
        except TimeoutError:
            raise PeerTimeout(f"perftest: nobody took '{op}' at {self.where} within {timeout_s:g} s "
                              "(is the other end running and reachable?)") from None

    async def recv(self, timeout_s: float, waiting_for: str) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while True:
            try:
                step = end - loop.time() if self.peer_alive is None else min(0.5, end - loop.time())
                raw = await asyncio.wait_for(self.sock.recv(), max(0.0, step))
                break
            except TimeoutError:
                if self.peer_alive is not None and not self.peer_alive():
                    raise PeerGone(f"perftest: the peer process exited while waiting for {waiting_for}") from None
                if loop.time() >= end:
                    raise PeerTimeout(f"perftest: no {waiting_for} from the peer ({self.where}) "
                                      f"within {timeout_s:g} s") from None
        msg = msgpack.unpackb(raw, raw=False)
        if not isinstance(msg, dict) or "op" not in msg:
            raise TransportError(f"perftest: malformed control message from {self.where}")
        if msg["op"] == "error":
            raise TransportError(f"perftest peer failed: {msg.get('message', '?')}")
        return msg

    async def expect(self, op: str, timeout_s: float) -> dict[str, Any]:
        msg = await self.recv(timeout_s, f"'{op}'")
        if msg["op"] != op:
            raise TransportError(f"perftest: expected '{op}' from the peer, got '{msg['op']}'")
        return msg

    def close(self) -> None:
        # A short linger: the last message (an error report, 'bye') must still reach the peer.
        self.sock.close(linger=1000)
