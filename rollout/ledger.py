"""The prompt ledger: where every prompt is, and why it left if it was dropped.

States: pending (waiting to start, including retries), in_flight (some
trajectory generating), finished (waiting in the buffer), trained (handed to
the trainer), dropped (with a reason: failure, a filter reason, stale, ...).
Counters per drop reason let metrics be checked against the ledger. `dump()` is
JSON-able for checkpoints; `restore()` returns in-flight and finished prompts to
pending (their generated data is not part of a checkpoint).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from miles.core.errors import MilesError

STATES = ("pending", "in_flight", "finished", "trained", "dropped")


class LedgerError(MilesError):
    """A prompt moved in a way the ledger does not allow (a bug in the caller)."""


@dataclass
class Entry:
    prompt_id: str
    state: str = "pending"
    attempts: int = 0  # how many times a group was started for it
    reasons: list[str] = field(default_factory=list)  # drop reasons, one per failed attempt
    trained_version: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_id": self.prompt_id, "state": self.state, "attempts": self.attempts,
                "reasons": list(self.reasons), "trained_version": self.trained_version}


class Ledger:
    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._pending: deque[str] = deque()  # retries go to the front
        self.retried = 0
        self.dropped_by_reason: Counter[str] = Counter()  # final drops
        self.drop_events: Counter[str] = Counter()  # every drop, retried or not

    def __contains__(self, prompt_id: str) -> bool:
        return prompt_id in self._entries

    def get(self, prompt_id: str) -> Entry:
        e = self._entries.get(prompt_id)
        if e is None:
            raise LedgerError(f"ledger: unknown prompt {prompt_id!r}")
        return e

    def _move(self, prompt_id: str, frm: tuple[str, ...], to: str) -> Entry:
        e = self.get(prompt_id)
        if e.state not in frm:
            raise LedgerError(f"ledger: prompt {prompt_id!r} cannot go {e.state} -> {to}")
        e.state = to
        return e

    def add(self, prompt_id: str) -> None:
        if prompt_id in self._entries:
            raise LedgerError(f"ledger: prompt {prompt_id!r} was already added")
        self._entries[prompt_id] = Entry(prompt_id)
        self._pending.append(prompt_id)

    def next_pending(self) -> str | None:
        return self._pending[0] if self._pending else None

    def start(self, prompt_id: str) -> int:
        """pending -> in_flight; returns the attempt number (1 for the first)."""
        if not self._pending or self._pending[0] != prompt_id:
            raise LedgerError(f"ledger: {prompt_id!r} is not next in the pending queue")
        self._pending.popleft()
        e = self._move(prompt_id, ("pending",), "in_flight")
        e.attempts += 1
        return e.attempts

    def finish(self, prompt_id: str) -> None:
        self._move(prompt_id, ("in_flight",), "finished")

    def train(self, prompt_id: str, version: int) -> None:
        e = self._move(prompt_id, ("finished",), "trained")
        e.trained_version = version

    def drop(self, prompt_id: str, reason: str, retry: bool) -> None:
        """in_flight/finished -> pending (retry, at the front) or dropped."""
        e = self._move(prompt_id, ("in_flight", "finished"), "pending" if retry else "dropped")
        e.reasons.append(reason)
        self.drop_events[reason] += 1
        if retry:
            self.retried += 1
            self._pending.appendleft(prompt_id)
        else:
            self.dropped_by_reason[reason] += 1

    def counts(self) -> dict[str, int]:
        c = Counter(e.state for e in self._entries.values())
        return {s: c.get(s, 0) for s in STATES} | {"retried": self.retried, "total": len(self._entries)}

    def in_state(self, state: str) -> list[str]:
        return [p for p, e in self._entries.items() if e.state == state]

    def last_trained_version(self) -> int | None:
        """The newest trainer version any prompt was trained at (None before the first step)."""
        return max((e.trained_version for e in self._entries.values() if e.trained_version is not None),
                   default=None)

    def dump(self) -> dict[str, Any]:
        return {"version": 1, "entries": [e.to_dict() for e in self._entries.values()],
                "pending": list(self._pending), "retried": self.retried,
                "dropped_by_reason": dict(self.dropped_by_reason), "drop_events": dict(self.drop_events)}

    @classmethod
    def restore(cls, d: dict[str, Any]) -> Ledger:
        if not isinstance(d, dict) or d.get("version") != 1:
            raise LedgerError("ledger dump: expected a dict with version 1")
        led = cls()
        for raw in d["entries"]:
            e = Entry(str(raw["prompt_id"]), str(raw["state"]), int(raw["attempts"]),
                      [str(r) for r in raw["reasons"]], raw.get("trained_version"))
            if e.state not in STATES:
                raise LedgerError(f"ledger dump: prompt {e.prompt_id!r} has unknown state {e.state!r}")
            led._entries[e.prompt_id] = e
        led._pending = deque(str(p) for p in d["pending"])
        # work that was generating or waiting is not in a checkpoint: it starts again first
        lost = [p for p, e in led._entries.items() if e.state in ("in_flight", "finished")]
        for p in reversed(lost):
            led._entries[p].state = "pending"
            led._pending.appendleft(p)
        led.retried = int(d["retried"])
        led.dropped_by_reason = Counter({str(k): int(v) for k, v in d["dropped_by_reason"].items()})
        led.drop_events = Counter({str(k): int(v) for k, v in d["drop_events"].items()})
        return led
