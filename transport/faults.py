"""Fault injection on the actor wire, for soak and chaos tests: drop or delay outgoing messages.

Off by default (`transport.faults`, all rates 0): `FaultHook.from_config` then returns None, the
host holds no hook and its send path is what it is without this module (one `is None` test).
On, each outgoing message draws from a seeded stream before it is sent:

- dropped (never sent) with probability `drop_rate`, if its type is in `drop_types` (empty: any),
  until the process has dropped `drop_limit` (0: no limit);
- otherwise delayed by uniform(0, `delay_ms`) with probability `delay_rate` (any type): the
  sending coroutine waits, so the delay counts against the deadline of the ask it belongs to.

A reply or error counts as its request's type. What a drop costs the protocol (see
docs/reliability.md): a lost ask or reply fails the asker with `PeerTimeout` at its deadline,
which is recovered only where the caller retries or the failure is accounted for (an
`engine.Generate` becomes a failed trajectory, retried or dropped with its reason; `engine.Health`
is asked again each second); a lost tell is gone (`rollout.SetVersion` is resent each step, an
`rt.Heartbeat` every interval). Requests whose loss is not recovered (a trainer's
`rollout.PullBatch`, the weight-sync steps, the directory's `rt.Register`) fail their role, which the launcher restarts or a resume continues, so
a soak drops only the recovered kinds and delays everything.

Counts are logged: each drop as `message_dropped`, and the running totals as `faults_injected`
at most once a second (a SIGKILLed process loses at most the last second's totals).
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from miles.core.logging import get_logger

if TYPE_CHECKING:
    from miles.core.schema.transport import FaultConfig

log = get_logger("miles.faults")
KIND_NAMES = {0: "ask", 1: "tell", 2: "reply", 3: "error", 4: "batch"}  # codec.ASK ... codec.BATCH


class FaultHook:
    """Seeded drop/delay decisions for one process's outgoing messages, with counts."""

    def __init__(self, cfg: FaultConfig, stream: int = 0) -> None:
        self.cfg = cfg
        self.drop_types = frozenset(cfg.drop_types)
        # One stream per process (seed, stream): the same sequence of sends draws the same faults.
        self._rng = random.Random(f"{cfg.seed}:{stream}")
        self._lock = threading.Lock()  # the heartbeat thread draws too
        self.dropped: Counter[str] = Counter()  # "<kind>:<type>" -> messages dropped
        self.delayed: Counter[str] = Counter()
        self.delayed_s = 0.0
        self._logged_at = 0.0
        self._changed = False

    @classmethod
    def from_config(cls, cfg: FaultConfig) -> FaultHook | None:
        """A hook when any fault is configured, else None (the send path stays as it is)."""
        if cfg.drop_rate <= 0 and (cfg.delay_rate <= 0 or cfg.delay_ms <= 0):
            return None
        return cls(cfg, os.getpid())

    def draw(self, kind: int, type_name: str, may_delay: bool = True) -> float | None:
        """None: drop this message; else the seconds to delay it (0.0: send now)."""
        cfg = self.cfg
        what = f"{KIND_NAMES.get(kind, str(kind))}:{type_name or '?'}"
        with self._lock:  # the count is read and raised under the lock: drop_limit holds across threads
            x = self._rng.random()
            drop = x < cfg.drop_rate and (not self.drop_types or type_name in self.drop_types)
            if drop and cfg.drop_limit and sum(self.dropped.values()) >= cfg.drop_limit:
                drop = False
            if drop:
                self.dropped[what] += 1
            delay = 0.0
            if not drop and may_delay and self._rng.random() < cfg.delay_rate:
                delay = self._rng.uniform(0.0, cfg.delay_ms / 1e3)
        if drop:
            log.info("message_dropped", message=what, dropped=sum(self.dropped.values()), pid=os.getpid())
        elif delay > 0:
            self.delayed[what] += 1
            self.delayed_s += delay
        self._changed |= drop or delay > 0
        if self._changed and time.monotonic() - self._logged_at >= 1.0:
            self.log_totals()
        return None if drop else delay

    async def admit(self, kind: int, type_name: str) -> bool:
        """Whether to send this message, after waiting out its injected delay."""
        delay = self.draw(kind, type_name)
        if delay is None:
            return False
        if delay > 0:
            await asyncio.sleep(delay)
        return True

    def log_totals(self) -> None:
        self._logged_at = time.monotonic()
        self._changed = False
        log.info("faults_injected", pid=os.getpid(), dropped=sum(self.dropped.values()),
                 delayed=sum(self.delayed.values()), delayed_s=round(self.delayed_s, 3),
                 dropped_by=dict(self.dropped))
