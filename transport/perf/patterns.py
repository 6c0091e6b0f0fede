"""The three traffic patterns, as one driver loop over a link and one plan per size.

- pingpong: one message, then the peer's ack; latency is that full round (send + ack).
- stream:   `window` messages in flight, one ack per window (osu_bw style); latency is
            the window's time divided by its messages.
- bucket:   like stream, where each message is a weight bucket; the miles side packs
            (stages) several tensors per bucket and the receiver copies them out, and the
            ack closing each window is the commit of the version those buckets form.
The same loop runs the raw baseline and the miles path, so their figures compare.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from miles.transport.perf.report import LatencyStats
from miles.transport.perf.sizes import iterations

PATTERNS = ("pingpong", "stream", "bucket")


@dataclass
class Plan:
    size: int
    measured: int
    warmup: int
    block: int  # messages per ack

    @property
    def total(self) -> int:
        return self.measured + self.warmup

    def to_wire(self) -> list[int]:
        return [self.size, self.measured, self.warmup, self.block]

    @classmethod
    def from_wire(cls, w: list[int]) -> Plan:
        return cls(*(int(x) for x in w))


def make_plans(pattern: str, sizes: list[int], iters: int, warmup: int, window: int, max_bytes: int) -> list[Plan]:
    block = 1 if pattern == "pingpong" else window
    out = []
    for s in sizes:
        n, w = iterations(s, iters, warmup, max_bytes, block)
        out.append(Plan(s, n, w, block))
    return out


class DriverLink(Protocol):
    async def send(self, size: int) -> None: ...

    async def ack(self) -> None: ...


class ResponderLink(Protocol):
    async def recv(self, size: int) -> None: ...

    async def ack(self) -> None: ...


async def drive(link: DriverLink, plan: Plan) -> LatencyStats:
    samples: list[float] = []
    seconds = 0.0
    for b in range(plan.total // plan.block):
        t0 = time.perf_counter()
        for _ in range(plan.block):
            await link.send(plan.size)
        await link.ack()
        dt = time.perf_counter() - t0
        if b * plan.block >= plan.warmup:
            samples.append(dt / plan.block)
            seconds += dt
    return LatencyStats.of(samples, plan.size, plan.measured, seconds)


async def respond(link: ResponderLink, plans: list[Plan]) -> None:
    for plan in plans:
        for _ in range(plan.total // plan.block):
            for _ in range(plan.block):
                await link.recv(plan.size)
            await link.ack()
