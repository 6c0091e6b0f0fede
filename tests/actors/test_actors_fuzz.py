"""10,000 malformed frames against a live actor: ProtocolError replies, no crash, still serving."""

from __future__ import annotations

import random

import msgpack
import pytest
import zmq
import zmq.asyncio
from echo_host import Echo

from miles.actors.runtime.host import Host
from miles.core.schema.transport import TransportConfig
from miles.transport import codec

HOST = "tests/actors/procs/echo_host.py"


def _malformed(rng: random.Random) -> list[bytes]:
    good = codec.encode(codec.ASK, rng.randrange(1 << 30), "echo", Echo("hi"))
    head = bytes(good[0])
    choice = rng.randrange(8)
    if choice == 0:
        return [rng.randbytes(rng.randrange(0, 200))]
    if choice == 1:
        return [head[: rng.randrange(1, len(head))]]
    if choice == 2:
        h = msgpack.unpackb(head)
        h[rng.randrange(9)] = rng.choice([None, -1, "x" * 5, [1, 2], {"a": 1}, 2**62, 3.5, True])
        return [msgpack.packb(h)]
    if choice == 3:
        h = msgpack.unpackb(head)
        h[7] = {"text": rng.choice([1, None, [], b"\x00"])}
        return [msgpack.packb(h)]
    if choice == 4:  # huge declared array size
        ext = msgpack.ExtType(1, msgpack.packb(["<f8", [1 << 30, 1 << 20], 1]))
        return [msgpack.packb([1, 0, 1, "echo", "t.Echo", 1, 1.0, {"text": "a", "arr": ext}, ""]), b"xx"]
    if choice == 5:  # deep nesting
        v: object = 1
        for _ in range(rng.randrange(40, 200)):
            v = [v]
        return [msgpack.packb([1, 0, 1, "echo", "t.Echo", 1, 1.0, {"text": v}, ""])]
    if choice == 6:  # extra unreferenced frames / bad ext codes
        return [head, rng.randbytes(10)] if rng.random() < 0.5 else [
            msgpack.packb([1, 0, 1, "echo", "t.Echo", 1, 1.0, {"text": msgpack.ExtType(9, b"zz")}, ""])]
    flip = bytearray(head)
    for _ in range(rng.randrange(1, 4)):
        flip[rng.randrange(len(flip))] = rng.randrange(256)
    return [bytes(flip)]


@pytest.mark.timeout(120)
async def test_fuzzed_frames_never_crash_the_actor(procs) -> None:
    proc, directory = procs.spawn([HOST, "--run-directory", "--name", "echo"])
    rng = random.Random(1234)
    ctx = zmq.asyncio.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(directory)  # the directory host also runs "echo"
    host = Host(TransportConfig(), directory)
    await host.start()
    try:
        errors = 0
        sent = 0
        for batch in range(100):
            for _ in range(100):
                await raw.send_multipart(_malformed(rng))
                sent += 1
            # Drain replies so far; malformed input is answered with ProtocolError-typed errors.
            # (A short poll: replies still on their way are drained with the next batch or at the end.)
            while await raw.poll(timeout=5):
                frames = await raw.recv_multipart()
                h = msgpack.unpackb(frames[0])
                if h[1] == codec.ERROR:
                    errors += 1
                    # A mutated (negative) deadline yields a well-formed request that expires.
                    assert h[7][0] in {"ProtocolError", "PeerTimeout"}, h[7]
            if batch % 20 == 0:
                out = await host.ref("echo").ask(Echo("alive"), timeout=10)
                assert out.text == "evila"
        while await raw.poll(timeout=500):
            h = msgpack.unpackb((await raw.recv_multipart())[0])
            errors += h[1] == codec.ERROR
        assert sent == 10_000
        assert errors > 5_000, f"only {errors} error replies"
        assert proc.poll() is None, procs.log_of(proc)
        assert (await host.ref("echo").ask(Echo("still"), timeout=10)).text == "llits"
    finally:
        raw.close(0)
        await host.stop()
