"""Discrete-event SIMULATION (a latency model, not a measurement) of sync vs asynchronous RL.

Used by bench/async_vs_sync.py for the fleet-size scale model. Generation and training
times are drawn from the `Latency` model below, not measured:
- an engine decodes all its running sequences together (continuous batching); one decode
  step takes `step_base_ms + step_per_seq_ms * running` and gives every sequence one token;
- response lengths are long-tailed: each prompt has a log-normal median length, each of
  its samples a log-normal factor around it (clipped to [min_len, max_len]); a retried
  prompt keeps its median, so long prompts stay long;
- a training step takes `train_fixed_s + tokens / (train_tok_s_per_engine * engines)` (the
  trainer is sized with the fleet); a weight update then pauses every engine for
  `update_s` (in-place pause: running sequences keep their tokens and go on afterwards).
Modes mirror the rollout actor: `sync` (generate a batch, then train), `one_step_off`
(the next batch generates while the trainer trains), `fully_async` (every free slot
starts work; staleness = trainer version - oldest version a group sampled with; stale
groups are dropped at collection and retried or discarded), optionally with admission
control (no new group while groups in flight + waiting reach (max_staleness+1) * batch),
or with `deadline=True` the deadline schedule, using the buffer's own admission test and
collection plan (miles.rollout.schedule): no stale drops; or with `budget=True` the same
admission test, arrival order and no stale drops at all (AReaL's scheme).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from miles.rollout.schedule import Outstanding, admits, plan


@dataclass
class Latency:
    step_base_ms: float = 20.0  # one decode step of an engine, fixed part (a ~7B model on one GPU)
    step_per_seq_ms: float = 0.15  # ... plus this per running sequence
    slots_per_engine: int = 64  # concurrent sequences per engine
    train_tok_s_per_engine: float = 3000.0  # training throughput per engine's worth of trainer GPUs
    train_fixed_s: float = 2.0
    update_s: float = 2.0  # weight update: engines paused
    median_len: float = 1200.0
    sigma_prompt: float = 1.0
    sigma_sample: float = 0.35
    min_len: int = 32
    max_len: int = 16384


@dataclass
class SimGroup:
    prompt: int
    attempt: int
    n: int
    started: int = 0
    done: int = 0
    lengths: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    seq: int = 0
    deadline: int = 0


@dataclass
class SimResult:
    mode: str
    engines: int
    trained_tokens: int
    seconds: float
    trained_len_mean: float
    generated_len_mean: float
    drops: int
    discarded: int
    max_staleness: int

    @property
    def tokens_per_s(self) -> float:
        return self.trained_tokens / self.seconds


class Simulator:
    def __init__(self, lat: Latency, engines: int, mode: str, groups_per_engine: int = 4, n: int = 8,
                 steps: int = 12, max_staleness: int = 2, admission: bool = False, max_attempts: int = 3,
                 seed: int = 0, deadline: bool = False, budget: bool = False) -> None:
        self.lat, self.E, self.mode, self.n, self.steps = lat, engines, mode, n, steps
        self.batch = groups_per_engine * engines
        self.eta, self.admission, self.max_attempts, self.seed = max_staleness, admission, max_attempts, seed
        self.deadline = deadline and mode == "fully_async"
        self.budget = budget and mode == "fully_async" and not deadline
        self.taken = (0, 0)  # (version, groups taken for it): the deadline admission test
        self.seq = 0
        slots = lat.slots_per_engine * engines
        self.remaining = np.zeros(slots)
        self.length = np.zeros(slots, dtype=np.int64)
        self.engine_of = np.repeat(np.arange(engines), lat.slots_per_engine)
        self.active = np.zeros(slots, dtype=bool)
        self.owner: list[SimGroup | None] = [None] * slots
        self.t = 0.0
        self.version = 0
        self.pending: deque[tuple[int, int]] = deque()  # (prompt, attempt): retries go first
        self.next_prompt = 0
        self.open: list[SimGroup] = []
        self.waiting: deque[SimGroup] = deque()
        self.released = 0  # sync / one_step_off: groups allowed in the current batch window
        self.gen_tokens = self.gen_samples = self.drops = self.discarded = 0
        self.max_seen_staleness = 0

    # -- workload ----------------------------------------------------------------
    def _length(self, prompt: int, sample: int) -> int:
        lat = self.lat
        med = random.Random(self.seed * 1_000_003 + prompt).lognormvariate(math.log(lat.median_len), lat.sigma_prompt)
        x = med * random.Random((self.seed * 1_000_003 + prompt) * 131 + sample + 1).lognormvariate(
            0.0, lat.sigma_sample)
        return max(lat.min_len, min(lat.max_len, round(x)))

    def _new_group(self) -> SimGroup:
        if self.pending:
            p, a = self.pending.popleft()
        else:
            p, a = self.next_prompt, 1
            self.next_prompt += 1
        self.seq += 1
        g = SimGroup(p, a, self.n, seq=self.seq, deadline=self.version + self.eta)
        self.open.append(g)
        return g

    # -- engines -----------------------------------------------------------------
    def _may_open_group(self) -> bool:
        if self.mode == "fully_async":
            if self.deadline or self.budget:
                taken = self.taken[1] if self.taken[0] == self.version else 0
                return admits(len(self.open) + len(self.waiting), taken, self.eta, self.batch)
            if self.admission:
                return len(self.open) + len(self.waiting) < (self.eta + 1) * self.batch
            return len(self.waiting) < 4 * self.batch  # max_waiting
        return self.released > 0

    def _fill(self) -> None:
        while not self.active.all():
            g = next((g for g in self.open if g.started < g.n), None)
            if g is None:
                if not self._may_open_group():
                    return
                if self.mode != "fully_async":
                    self.released -= 1
                g = self._new_group()
            running = np.bincount(self.engine_of[self.active], minlength=self.E)
            free = [e for e in range(self.E) if running[e] < self.lat.slots_per_engine]
            e = min(free, key=lambda k: running[k])  # least-loaded engine
            slot = int(np.flatnonzero((self.engine_of == e) & ~self.active)[0])
            length = self._length(g.prompt, g.started)
            g.lengths.append(length)
            g.versions.append(self.version)
            g.started += 1
            self.active[slot], self.remaining[slot], self.owner[slot] = True, float(length), g
            self.length[slot] = length

    def _token_time(self) -> np.ndarray:
        running = np.bincount(self.engine_of[self.active], minlength=self.E)
        per_engine = (self.lat.step_base_ms + self.lat.step_per_seq_ms * running) / 1000.0
        return per_engine[self.engine_of]

    def _advance(self, until: float, paused: bool = False, stop_on_finish: bool = False) -> None:
        """Run the engines to time `until` (or, with stop_on_finish, to the next finish before it)."""
        while self.t < until:
            if paused or not self.active.any():
                self.t = until
                return
            tt = self._token_time()
            finish_in = np.where(self.active, self.remaining * tt, np.inf)
            dt = min(float(finish_in.min()), until - self.t)
            self.remaining[self.active] -= dt / tt[self.active]
            self.t += dt
            done = np.flatnonzero(self.active & (self.remaining <= 1e-6))
            for slot in done:
                self._finish(int(slot))
            if len(done):
                self._fill()
                if stop_on_finish:
                    return  # let the caller react (a batch may be ready)

    def _finish(self, slot: int) -> None:
        g = self.owner[slot]
        assert g is not None
        self.active[slot], self.owner[slot] = False, None
        g.done += 1
        self.gen_samples += 1
        self.gen_tokens += int(self.length[slot])
        if g.done == g.n:
            self.open.remove(g)
            self.waiting.append(g)

    # -- trainer -----------------------------------------------------------------
    def _collect(self, got: list[SimGroup]) -> None:
        if self.deadline:
            items: list[Outstanding[SimGroup]] = [Outstanding(g.seq, g.deadline, None) for g in self.open]
            items += [Outstanding(g.seq, g.deadline, g) for g in self.waiting]
            take, _ = plan(items, self.batch - len(got), self.version, self.batch)
            for g in take:
                self.waiting.remove(g)
                self.max_seen_staleness = max(self.max_seen_staleness, self.version - min(g.versions))
            got += take
            self.taken = (self.version, len(got))
            return
        while self.waiting and len(got) < self.batch:
            g = self.waiting.popleft()
            st = self.version - min(g.versions)
            if self.mode == "fully_async" and st > self.eta and not self.budget:
                self.drops += 1
                if g.attempt < self.max_attempts:
                    self.pending.appendleft((g.prompt, g.attempt + 1))
                else:
                    self.discarded += 1
                continue
            self.max_seen_staleness = max(self.max_seen_staleness, st)
            got.append(g)
        self.taken = (self.version, len(got))

    def run(self) -> SimResult:
        trained_tokens = trained_samples = 0
        t_first = 0.0
        if self.mode != "fully_async":
            self.released = self.batch
        self._fill()
        for step in range(self.steps + 1):
            got: list[SimGroup] = []
            while True:
                self._collect(got)
                self._fill()  # collecting may have opened admission (the actor wakes its pump)
                if len(got) == self.batch:
                    break
                self._advance(math.inf, stop_on_finish=True)
            if self.mode == "one_step_off":
                self.released = self.batch  # the next batch generates while this one trains
                self._fill()
            tokens = sum(sum(g.lengths) for g in got)
            self._advance(self.t + self.lat.train_fixed_s + tokens / (self.lat.train_tok_s_per_engine * self.E))
            self._advance(self.t + self.lat.update_s, paused=True)
            self.version += 1
            if self.mode == "sync":
                self.released = self.batch  # generation starts only after the update
                self._fill()
            if step == 0:
                t_first = self.t  # the first step fills the pipeline: not counted
            else:
                trained_tokens += tokens
                trained_samples += sum(g.n for g in got)
        seconds = self.t - t_first
        label = "+deadline" if self.deadline else "+budget" if self.budget else "+admission" if self.admission else ""
        return SimResult(self.mode + label, self.E, trained_tokens, seconds,
                         trained_tokens / max(1, trained_samples), self.gen_tokens / max(1, self.gen_samples),
                         self.drops, self.discarded, self.max_seen_staleness)
