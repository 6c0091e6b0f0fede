"""A send on a socket its host already closed (the process is stopping) is a clear TransportError,
not zmq's raw ENOTSOCK: a trainer stopping mid weight-push showed 'Socket operation on non-socket'."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from miles.core.errors import TransportError
from miles.transport.sockets import LoopSocket

pytestmark = pytest.mark.timeout(30)


async def test_send_after_close_names_the_stop() -> None:
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    got: list[list[object]] = []
    d = LoopSocket(sock, got.append)
    d.start(asyncio.get_running_loop())
    try:
        await d.send([b"before"], what="Resume to 'engine-0'")
        assert router.poll(5000)
        assert router.recv_multipart()[-1] == b"before"  # the socket works until it is closed
        d.close()
        with pytest.raises(TransportError, match="Resume to 'engine-0': the socket is closed; this process is stopping"):
            await d.send([b"after"], what="Resume to 'engine-0'")
    finally:
        router.close(0)
