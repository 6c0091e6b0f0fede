"""Test process: runs the directory (optional) and test actors; used by multi-process tests."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from miles.actors.runtime.actor import Actor, handler
from miles.actors.runtime.host import Host
from miles.actors.runtime.process import run
from miles.core.errors import EngineError
from miles.core.schema.transport import TransportConfig
from miles.transport.schema import message


@message("t.Echo")
@dataclass
class Echo:
    text: str
    arr: np.ndarray | None = None


@message("t.Sleep")
@dataclass
class Sleep:
    seconds: float


@message("t.Sleeping")
@dataclass
class Sleeping:
    """Ask how many Sleep asks the actor is inside now (a test waits for its ask to arrive)."""


@message("t.Block")
@dataclass
class Block:
    seconds: float


@message("t.Fail")
@dataclass
class Fail:
    why: str


@message("t.Count")
@dataclass
class Count:
    n: int


@message("t.GetCount")
@dataclass
class GetCount:
    pass


class EchoActor(Actor):
    def __init__(self) -> None:
        self.count = 0
        self.sleeping = 0

    @handler(Echo, concurrency=8)
    def echo(self, msg: Echo) -> Echo:
        return Echo(msg.text[::-1], None if msg.arr is None else msg.arr * 2)

    @handler(Sleep, concurrency=4)
    async def sleep(self, msg: Sleep) -> float:
        self.sleeping += 1
        try:
            await asyncio.sleep(msg.seconds)
        finally:
            self.sleeping -= 1
        return msg.seconds

    @handler(Sleeping)
    def on_sleeping(self, msg: Sleeping) -> int:
        return self.sleeping

    @handler(Block)
    def block(self, msg: Block) -> None:
        time.sleep(msg.seconds)  # on purpose: stalls the whole event loop, heartbeats included

    @handler(Fail)
    def fail(self, msg: Fail) -> None:
        raise EngineError(f"asked to fail: {msg.why}")

    @handler(Count)
    def on_count(self, msg: Count) -> None:
        self.count += msg.n

    @handler(GetCount)
    def get_count(self, msg: GetCount) -> int:
        return self.count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--directory", default="")
    ap.add_argument("--run-directory", action="store_true")
    ap.add_argument("--name", action="append", default=[])
    ap.add_argument("--scheme", default="tcp")
    ap.add_argument("--stall-timeout", type=float, default=60.0)
    ap.add_argument("--ready", required=True)
    a = ap.parse_args()
    cfg = TransportConfig(scheme=a.scheme, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0,
                          loop_stall_timeout_s=a.stall_timeout)

    async def setup(host: Host) -> None:
        for n in a.name:
            await host.add(EchoActor(), n)

    sys.exit(run(setup, cfg=cfg, directory=a.directory or None, run_directory=a.run_directory,
                 ready_file=a.ready))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
