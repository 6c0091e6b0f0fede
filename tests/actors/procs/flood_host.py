"""Test process: one actor with a slow "block" handler and a small "refuse" handler, small mailboxes.

Used by the backpressure tests: a flood into `Soak` must stop at the mailbox bound (the
process's RSS is read from /proc by the test) and `Ping1` asks beyond the bound are refused.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass

from miles.actors.runtime.actor import Actor, handler
from miles.actors.runtime.host import Host
from miles.actors.runtime.process import run
from miles.core.schema.transport import TransportConfig
from miles.transport.schema import message


@message("t.Hold")
@dataclass
class Hold:
    seconds: float
    gate: str = ""  # a file path: the hold ends early once it exists


@message("t.Soak")
@dataclass
class Soak:
    data: bytes


@message("t.Soaked")
@dataclass
class Soaked:
    pass


@message("t.Slow1")
@dataclass
class Slow1:
    seconds: float


class FloodActor(Actor):
    def __init__(self) -> None:
        self.until = 0.0
        self.gate = ""
        self.soaked = 0
        self.soaked_bytes = 0

    @handler(Hold)
    def hold(self, msg: Hold) -> None:
        self.until = time.monotonic() + msg.seconds
        self.gate = msg.gate

    @handler(Soak)
    async def soak(self, msg: Soak) -> None:
        # Stalls until the hold expires or its gate file appears: the consumer that never keeps up.
        while time.monotonic() < self.until and not (self.gate and os.path.exists(self.gate)):
            await asyncio.sleep(0.05)
        self.soaked += 1
        self.soaked_bytes += len(msg.data)

    @handler(Soaked)
    def get_soaked(self, msg: Soaked) -> list[int]:
        return [self.soaked, self.soaked_bytes]

    @handler(Slow1, when_full="refuse")
    async def slow1(self, msg: Slow1) -> float:
        await asyncio.sleep(msg.seconds)
        return msg.seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mailbox", type=int, default=8)
    ap.add_argument("--ready", required=True)
    a = ap.parse_args()
    cfg = TransportConfig(mailbox_size=a.mailbox, heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0)

    async def setup(host: Host) -> None:
        await host.add(FloodActor(), "flood")

    sys.exit(run(setup, cfg=cfg, run_directory=True, ready_file=a.ready))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
