"""Ids, clocks and deadlines shared by every process."""

from __future__ import annotations

import os
import time
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
