"""Ids, clocks and deadlines shared by every process."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

from miles.core.errors import PeerTimeout


def new_id(prefix: str = "") -> str:
    """A random 96-bit hex id, optionally prefixed (e.g. 'sess-')."""
    return prefix + os.urandom(12).hex()


def now() -> float:
    """Monotonic seconds; for deadlines and durations, never for wall time."""
    return time.monotonic()


@dataclass(frozen=True, slots=True)
class Deadline:
    """An absolute monotonic deadline; every wait in miles is bounded by one."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def check(self, what: str) -> None:
        if self.expired():
            raise PeerTimeout(f"deadline passed while {what}")


class Phases:
    """Wall time of one loop iteration's named phases, reported as `perf/<name>_s`.

    `perf/step_time_s` is the whole iteration and `perf/other_s` what no phase covers, so
    the phases and `other` add up to the step."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.spent: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.spent[name] = self.spent.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t)

    def metrics(self) -> dict[str, float]:
        total = time.perf_counter() - self.t0
        out = {f"perf/{k}_s": v for k, v in self.spent.items()}
        out["perf/step_time_s"] = total
        out["perf/other_s"] = max(0.0, total - sum(self.spent.values()))
        return out
