"""Transport benchmark: raw zmq.asyncio vs miles actors, between two processes, in one run.

Measures ask round-trip latency, small-message throughput (unbatched and batched tells)
and a 64 MiB tensor, each against a raw pyzmq baseline taken in the same run.
Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import uvloop
import zmq
import zmq.asyncio

from miles.actors.runtime.actor import Actor, handler
from miles.actors.runtime.host import Host
from miles.actors.runtime.process import serve
from miles.core.logging import configure_logging
from miles.core.schema.transport import TransportConfig
from miles.transport.schema import message

SMALL = b"x" * 64


@message("bench.Ping")
@dataclass
class Ping:
    payload: bytes


@message("bench.Count")
@dataclass
class Count:
    payload: bytes


@message("bench.WaitCount")
@dataclass
class WaitCount:
    target: int


@message("bench.Bulk")
@dataclass
class Bulk:
    data: np.ndarray


class Sink(Actor):
    def __init__(self) -> None:
        self.count = 0
        self.target = -1
        self.reached = asyncio.Event()

    @handler(Ping)
    def ping(self, msg: Ping) -> bytes:
        return msg.payload

    @handler(Count)
    def on_count(self, msg: Count) -> None:
        self.count += 1
        if self.count == self.target:
            self.reached.set()

    @handler(WaitCount)
    async def wait_count(self, msg: WaitCount) -> int:
        if self.count < msg.target:
            self.target = msg.target
            await self.reached.wait()
        n, self.count, self.target = self.count, 0, -1
        self.reached.clear()
        return n

    @handler(Bulk)
    def bulk(self, msg: Bulk) -> int:
        return int(msg.data.nbytes)


async def raw_server(sock: zmq.asyncio.Socket) -> None:
    """Raw ROUTER: echo pings, count 'c' messages and answer 'w<n>' when n have arrived."""
    count = 0
    waiter = None
    while True:
        frames = await sock.recv_multipart(copy=False)
        ident, kind = frames[0], frames[1].bytes[:1]
        if kind == b"p":
            await sock.send_multipart([ident, frames[1]], copy=False)
        elif kind == b"c":
            count += 1
            if waiter is not None and count == waiter[1]:
                await sock.send_multipart([waiter[0], b"%d" % count])
                count, waiter = 0, None
        elif kind == b"w":
            target = int(frames[1].bytes[1:])
            if count >= target:
                await sock.send_multipart([ident, b"%d" % count])
                count = 0
            else:
                waiter = (ident, target)
        elif kind == b"b":
            await sock.send_multipart([ident, b"%d" % len(frames[2].buffer)])


def run_server(ready: str) -> int:
    async def setup(host: Host) -> None:
        await host.add(Sink(), "sink")
        raw = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        raw.setsockopt(zmq.SNDHWM, 100000)
        raw.setsockopt(zmq.RCVHWM, 100000)
        port = raw.bind_to_random_port("tcp://127.0.0.1")
        host._bench_raw = asyncio.create_task(raw_server(raw))  # type: ignore[attr-defined]
        with open(ready + ".raw", "w") as f:
            f.write(f"tcp://127.0.0.1:{port}")

    cfg = TransportConfig(hwm=100000)
    return uvloop.run(serve(setup, cfg=cfg, run_directory=True, ready_file=ready))


async def client(directory: str, raw_addr: str, n_rtt: int, n_small: int, n_bulk: int) -> dict:
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.SNDHWM, 100000)
    raw.setsockopt(zmq.RCVHWM, 100000)
    raw.connect(raw_addr)
    host = Host(TransportConfig(hwm=100000), directory)
    await host.start()
    sink = host.ref("sink")
    res: dict = {}

    async def raw_rtt() -> float:
        t = time.perf_counter()
        await raw.send(b"p" + SMALL)
        await raw.recv()
        return time.perf_counter() - t

    async def miles_rtt() -> float:
        t = time.perf_counter()
        await sink.ask(Ping(SMALL), timeout=10)
        return time.perf_counter() - t

    for _ in range(200):  # warm-up both paths
        await raw_rtt()
        await miles_rtt()
    raw_l, miles_l = [], []
    for _ in range(n_rtt):  # interleaved so machine noise hits both alike
        raw_l.append(await raw_rtt())
        miles_l.append(await miles_rtt())
    res["raw_rtt_us"] = statistics.median(raw_l) * 1e6
    res["ask_rtt_us"] = statistics.median(miles_l) * 1e6

    async def raw_small() -> float:
        t = time.perf_counter()
        for _ in range(n_small):
            await raw.send(b"c" + SMALL)
        await raw.send(b"w%d" % n_small)
        await raw.recv()
        return n_small / (time.perf_counter() - t)

    async def miles_small() -> float:
        t = time.perf_counter()
        msg = Count(SMALL)
        for _ in range(n_small):
            await sink.tell(msg)
        await sink.ask(WaitCount(n_small), timeout=60)
        return n_small / (time.perf_counter() - t)

    async def miles_batched(batch: int = 64) -> float:
        t = time.perf_counter()
        msgs = [Count(SMALL)] * batch
        for _ in range(n_small // batch):
            await sink.tell_many(msgs)
        await sink.ask(WaitCount(n_small // batch * batch), timeout=60)
        return n_small // batch * batch / (time.perf_counter() - t)

    rs, ms, mb = [], [], []
    for _ in range(3):
        rs.append(await raw_small())
        ms.append(await miles_small())
        mb.append(await miles_batched())
    res["raw_small_msgs_per_s"] = statistics.median(rs)
    res["miles_small_msgs_per_s"] = statistics.median(ms)
    res["miles_batched_msgs_per_s"] = statistics.median(mb)

    arr = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
    rb, mbk = [], []
    for i in range(n_bulk + 1):
        t = time.perf_counter()
        await raw.send_multipart([b"b", arr], copy=False)
        await raw.recv()
        r = time.perf_counter() - t
        t = time.perf_counter()
        assert await sink.ask(Bulk(arr), timeout=60) == arr.nbytes
        m = time.perf_counter() - t
        if i:  # first round is warm-up
            rb.append(arr.nbytes / r / 1e9)
            mbk.append(arr.nbytes / m / 1e9)
    res["raw_64mib_gbps"] = statistics.median(rb)
    res["miles_64mib_gbps"] = statistics.median(mbk)
    raw.close(0)
    await host.stop()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--serve", default="")
    ap.add_argument("--rtt-iters", type=int, default=2000)
    ap.add_argument("--small", type=int, default=20000)
    ap.add_argument("--bulk-iters", type=int, default=8)
    a = ap.parse_args()
    configure_logging("warning", json=True)
    if a.serve:
        sys.exit(run_server(a.serve))
    with tempfile.TemporaryDirectory() as tmp:
        ready = os.path.join(tmp, "ready")
        srv = subprocess.Popen([sys.executable, __file__, "--serve", ready])
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(ready):
                if srv.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("benchmark server failed to start")
                time.sleep(0.05)
            directory = open(ready).read()
            raw_addr = open(ready + ".raw").read()
            r = uvloop.run(client(directory, raw_addr, a.rtt_iters, a.small, a.bulk_iters))
        finally:
            srv.terminate()
            srv.wait(10)
    out = {
        "ask_rtt_ratio": r["ask_rtt_us"] / r["raw_rtt_us"],
        "small_msg_ratio": r["miles_small_msgs_per_s"] / r["raw_small_msgs_per_s"],
        "small_msg_batched_ratio": r["miles_batched_msgs_per_s"] / r["raw_small_msgs_per_s"],
        "bulk_64mib_ratio": r["miles_64mib_gbps"] / r["raw_64mib_gbps"],
        **{k: round(v, 3) for k, v in r.items()},
    }
    rows = [
        ("ask round trip (µs, p50)", r["raw_rtt_us"], r["ask_rtt_us"], out["ask_rtt_ratio"], "≤ 1.3"),
        ("small msgs/s (unbatched)", r["raw_small_msgs_per_s"], r["miles_small_msgs_per_s"],
         out["small_msg_ratio"], "≥ 0.8"),
        ("small msgs/s (batched 64)", r["raw_small_msgs_per_s"], r["miles_batched_msgs_per_s"],
         out["small_msg_batched_ratio"], "≥ 3"),
        ("64 MiB tensor (GB/s)", r["raw_64mib_gbps"], r["miles_64mib_gbps"], out["bulk_64mib_ratio"], "≥ 0.8"),
    ]
    print(f"{'measure':28} {'raw':>12} {'miles':>12} {'ratio':>7}  goal")
    for name, raw_v, miles_v, ratio, goal in rows:
        print(f"{name:28} {raw_v:12.1f} {miles_v:12.1f} {ratio:7.2f}  {goal}")
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}))


if __name__ == "__main__":
    main()
