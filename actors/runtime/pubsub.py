"""Pub/sub fan-out over ZeroMQ PUB/SUB, for broadcasts such as weight-version announcements.

The subscriber needs only the transport's settings, not the host that owns it: it takes the
`TransportConfig`, so this module sits below host.py and imports nothing of the runtime.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import zmq

from miles.core.errors import ProtocolError
from miles.core.logging import get_logger
from miles.core.schema.transport import TransportConfig
from miles.transport import codec
from miles.transport.curve import make_curve_client
from miles.transport.sockets import socket

log = get_logger("miles.pubsub")


async def publish_frames(pub: Any, topic: str, frames: list[Any]) -> None:
    await pub.send_multipart([topic.encode(), *frames], copy=False)


class Subscriber:
    """One SUB socket per host, connected to any number of publishers, dispatching by topic."""

    def __init__(self, cfg: TransportConfig) -> None:
        self.cfg = cfg
        self.sock = socket(zmq.SUB, hwm=cfg.hwm, linger_ms=0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_frame_bytes)
        if cfg.curve_client_key:
            make_curve_client(self.sock, cfg.curve_client_key, cfg.curve_public_key)
        self.callbacks: dict[str, list[Callable[[Any], Any]]] = {}
        self.connected: set[str] = set()
        self.tasks: list[asyncio.Task[Any]] = [asyncio.create_task(self._loop(), name="host-sub")]

    async def subscribe(self, pub_address: str, topic: str, callback: Callable[[Any], Any]) -> None:
        if pub_address not in self.connected:
            self.sock.connect(pub_address)
            self.connected.add(pub_address)
        if topic not in self.callbacks:
            self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
            self.callbacks[topic] = []
        self.callbacks[topic].append(callback)
        # PUB/SUB joins are asynchronous ("slow joiner"); give the subscription time to reach the publisher.
        await asyncio.sleep(0.05)

    async def _loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            topic = frames[0].bytes.decode(errors="replace")
            try:
                env = codec.decode(frames[1:], self.cfg.max_frame_bytes)
            except ProtocolError as exc:
                log.warning("bad_broadcast", topic=topic, error=str(exc))
                continue
            for cb in self.callbacks.get(topic, []):
                try:
                    res = cb(env.body)
                    if asyncio.iscoroutine(res):
                        await res
                except Exception as exc:  # noqa: BLE001 - one bad callback must not stop the others
                    log.error("subscriber_callback_failed", topic=topic, error=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self.sock.close(0)
