"""The bounded rollout buffer (plain class; rollout/orchestrator.py drives it, actors/rollout.py is the shell).

Slots: at most `capacity` trajectories generate at once. A finished trajectory
frees its slot and `finish` returns the new work that starts in it right away
(the next trajectory of an open group, else the first of a new group). A
group's n trajectories may therefore start at different times, as in the seed's
walkthrough. Finished groups wait in arrival order (at most `max_waiting`; new
work pauses while that many wait) and the trainer takes the oldest.

Drops: when a group arrives - generation failure (any sample aborted/failed) or
the user filter `(group) -> (keep, reason)`; when it is collected - staleness,
trainer version minus the oldest sampled-token version above `max_staleness`.
Dropped prompts are retried (up to `max_attempts`) or discarded by policy;
filter-rejected ones are always discarded. Every prompt's whereabouts are in the `Ledger`.

Schedules (`schedule`): 'arrival' hands the trainer the oldest *finished* groups and
drops stale ones at collection; its optional admission control starts no new group
while the groups in flight plus waiting reach `(max_staleness + 1) * batch_groups`.
'deadline' (rollout/schedule.py) admits a group under that bound with the deadline
admission version + max_staleness and collects so that every group is trained by its
deadline: nothing goes stale, so long groups are not dropped in favour of short ones.
'budget' (as AReaL) admits under the same version budget, trains in arrival order and
never drops for staleness: nothing is wasted and nothing waits, but a long group's oldest
tokens may be more than max_staleness versions old when it is trained.
`BiasMeter` (rollout/bias.py) measures what the trainer gets against what was generated.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles.core.errors import ConfigError, MilesError
from miles.core.logging import get_logger
from miles.core.schema.buffer import DEFAULTS, BufferConfig, RetryPolicy, Schedule, check_buffer
from miles.rollout.bias import BiasMeter, P
from miles.rollout.filters import FilterFn, check_verdict, keep_all, load_filter
from miles.rollout.ledger import Ledger
from miles.rollout.schedule import Outstanding, admits, plan
from miles.rollout.types import Group, Sample

log = get_logger("miles.buffer")


class BufferError(MilesError):
    """A buffer call that does not fit its state (unknown work, finished twice, ...)."""


@dataclass
class Work:
    """One trajectory to generate: sample `sample_index` of group `group_id`."""

    group_id: str
    prompt_id: str
    sample_index: int
    prompt: dict[str, Any]
    attempt: int = 1

    def to_wire(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Work:
        return cls(str(d["group_id"]), str(d["prompt_id"]), int(d["sample_index"]), dict(d["prompt"]),
                   int(d.get("attempt", 1)))


@dataclass
class _Group:
    id: str
    prompt_id: str
    prompt: dict[str, Any]
    attempt: int
    n: int
    seq: int = 0  # admission order
    deadline: int = 0  # latest trainer version that may train it (schedule 'deadline')
    started: int = 0
    running: set[int] = field(default_factory=set)
    results: dict[int, list[Sample]] = field(default_factory=dict)
    failed: bool = False

    def complete(self) -> bool:
        return not self.running and (self.failed or len(self.results) == self.n)

    def to_group(self) -> Group:
        samples = [s for i in sorted(self.results) for s in self.results[i]]
        return Group(self.prompt_id, samples, int(self.prompt.get("index", 0)),
                     {"group_id": self.id, "attempt": self.attempt})


class RolloutBuffer:
    # defaults and rules are the section's (core/schema/buffer.py); max_staleness None = no bound
    def __init__(self, capacity: int, n_samples: int, max_staleness: int | None = DEFAULTS.max_staleness,
                 retry: RetryPolicy = DEFAULTS.retry, max_attempts: int = DEFAULTS.max_attempts,
                 admission_control: bool = DEFAULTS.admission_control, batch_groups: int = DEFAULTS.batch_groups,
                 max_waiting: int = DEFAULTS.max_waiting, filter_fn: FilterFn | None = None,
                 prompt_source: Callable[[], dict[str, Any] | None] | None = None,
                 ledger: Ledger | None = None, schedule: Schedule = DEFAULTS.schedule,
                 bias_window: int = DEFAULTS.bias_window) -> None:
        check_buffer(capacity, batch_groups, max_attempts, bias_window,
                     -1 if max_staleness is None else max_staleness, admission_control)
        if n_samples < 1:
            raise ConfigError(f"buffer: n_samples ({n_samples}) must be >= 1")
        # with no staleness bound nothing goes stale: arrival order has no drop bias to remove
        self.schedule: Schedule = schedule if max_staleness is not None else "arrival"
        self.version = 0  # the latest weight version the rollout side knows (admission deadlines)
        self._taken = (0, 0)  # (trainer version, groups taken for it so far)
        self._last_collect: int | None = None  # trainer version of the last collection
        self.stride = 1  # versions one training step advances, as last seen (deadline admission)
        self.bias = BiasMeter(bias_window)
        self.capacity, self.n = capacity, n_samples
        self.max_staleness, self.retry, self.max_attempts = max_staleness, retry, max_attempts
        self.admission_control, self.batch_groups = admission_control, batch_groups
        self.max_waiting = max_waiting or max(capacity, batch_groups)
        self.filter_fn = filter_fn or keep_all
        self.prompt_source = prompt_source
        self.ledger = ledger or Ledger()
        self._prompts: dict[str, dict[str, Any]] = {}
        self._open: dict[str, _Group] = {}  # groups with a trajectory running or not yet started
        self._waiting: deque[Group] = deque()  # finished, in arrival order
        self._running = 0
        self._seq = 0
        # per-step counters, reset by step_metrics()
        self._aborted = 0
        self._stale = 0
        self._drops: Counter[str] = Counter()
        self._drawn_staleness: list[int] = []
        self.totals: Counter[str] = Counter()

    @classmethod
    def from_config(cls, cfg: BufferConfig, n_samples: int,
                    prompt_source: Callable[[], dict[str, Any] | None] | None = None) -> RolloutBuffer:
        # sync / one_step_off bound staleness by when work may generate (the rollout actor):
        # their groups train in arrival order
        schedule = cfg.schedule if cfg.mode == "fully_async" else "arrival"
        # ... and generate one batch at a time: their slots are one batch, whatever capacity says
        capacity = cfg.capacity if cfg.mode == "fully_async" else cfg.batch_groups * n_samples
        return cls(capacity, n_samples, None if cfg.max_staleness < 0 else cfg.max_staleness,
                   cfg.retry, cfg.max_attempts, cfg.admission_control, cfg.batch_groups, cfg.max_waiting,
                   load_filter(cfg.filter_fn), prompt_source, schedule=schedule, bias_window=cfg.bias_window)

    # -- prompts ---------------------------------------------------------------
    def add_prompts(self, prompts: list[dict[str, Any]]) -> None:
        for p in prompts:
            pid = p.get("id")
            if not isinstance(pid, str):
                raise BufferError(f"buffer: a prompt needs a string 'id', got {pid!r}")
            self._prompts[pid] = p
            self.ledger.add(pid)

    def _next_prompt(self) -> str | None:
        pid = self.ledger.next_pending()
        if pid is None and self.prompt_source is not None:
            p = self.prompt_source()
            if p is not None:
                self.add_prompts([p])
                pid = self.ledger.next_pending()
        return pid

    # -- state -----------------------------------------------------------------
    @property
    def running(self) -> int:
        return self._running

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def group_open(self, group_id: str) -> bool:
        """Has the group a trajectory running or still to start? (False once it arrived.)"""
        return group_id in self._open

    def groups_in_flight(self) -> list[str]:
        return [g.id for g in self._open.values() if g.running or g.started < g.n]

    def ready(self, n_groups: int | None = None) -> bool:
        """Could a batch of `n_groups` be collected whole right now?"""
        n = n_groups or self.batch_groups
        if self.schedule != "deadline":
            return len(self._waiting) >= n
        take, wait = self._plan(n, self.version)
        return wait == 0 and len(take) == n

    def set_version(self, version: int) -> None:
        """The rollout side learned of a newer weight version (new groups get later deadlines)."""
        self.version = max(self.version, version)

    def _taken_now(self) -> int:
        v, k = self._taken
        return k if v >= self.version else 0

    def _admits_new_group(self) -> bool:
        if len(self._waiting) >= self.max_waiting:
            return False
        outstanding = len(self._open) + len(self._waiting)
        if self.schedule != "arrival":
            assert self.max_staleness is not None
            return admits(outstanding, self._taken_now(), self.max_staleness, self.batch_groups, self.stride)
        if not self.admission_control:
            return True
        assert self.max_staleness is not None
        return outstanding < (self.max_staleness + 1) * self.batch_groups

    # -- generation ------------------------------------------------------------
    def fill(self) -> list[Work]:
        """Start work in every free slot; returns what the caller must now generate."""
        out: list[Work] = []
        while self._running < self.capacity:
            g = next((g for g in self._open.values() if g.started < g.n and not g.failed), None)
            if g is None:
                if not self._admits_new_group():
                    break
                pid = self._next_prompt()
                if pid is None:
                    break
                attempt = self.ledger.start(pid)
                self._seq += 1
                g = _Group(f"{pid}#{attempt}", pid, self._prompts[pid], attempt, self.n, self._seq,
                           self.version + (self.max_staleness or 0))
                self._open[g.id] = g
                self.totals["groups_started"] += 1
            i = g.started
            g.started += 1
            g.running.add(i)
            self._running += 1
            out.append(Work(g.id, g.prompt_id, i, g.prompt, g.attempt))
        return out

    def _take(self, work: Work) -> _Group:
        g = self._open.get(work.group_id)
        if g is None or work.sample_index not in g.running:
            raise BufferError(f"buffer: work {work.group_id}[{work.sample_index}] is not running "
                              "(finished twice, or from before a restore?)")
        g.running.discard(work.sample_index)
        self._running -= 1
        return g

    def finish(self, work: Work, samples: list[Sample]) -> list[Work]:
        """A trajectory finished (its samples carry rewards); returns the work started in its slot."""
        if not samples:
            raise BufferError(f"buffer: work {work.group_id}[{work.sample_index}] finished with no sample")
        g = self._take(work)
        g.results[work.sample_index] = samples
        self.bias.generated(samples)
        if any(s.status in ("aborted", "failed") for s in samples):
            g.failed = True
        if g.complete():
            self._arrive(g)
        return self.fill()

    def fail(self, work: Work, error: str) -> list[Work]:
        """Generation of a trajectory failed; its group is dropped when its other trajectories end."""
        return self.finish(work, [Sample(prompt_ids=[], status="failed", index=work.sample_index,
                                         metadata={"error": error})])

    def _drop(self, prompt_id: str, attempt: int, reason: str, retryable: bool) -> None:
        retry = retryable and self.retry == "retry" and attempt < self.max_attempts
        self.ledger.drop(prompt_id, reason, retry)

    def _arrive(self, g: _Group) -> None:
        del self._open[g.id]
        group = g.to_group()
        group.metadata |= {"seq": g.seq, "deadline": g.deadline}
        if g.failed or group.failed():
            self._aborted += 1
            self.totals["aborted_groups_filtered"] += 1
            self.bias.dropped(group, "failed")
            # counted under "failed"; the line says which samples and why (an engine's abort has no error text)
            log.warning("group_dropped_failed", group=g.id, prompt=g.prompt_id, attempt=g.attempt,
                        why=group.failure())
            self._drop(g.prompt_id, g.attempt, "failed", retryable=True)
            return
        keep, reason = check_verdict(self.filter_fn(group), "buffer.filter_fn")
        if not keep:
            self._drops[reason] += 1
            self.totals[f"drop_{reason}"] += 1
            self.bias.dropped(group, reason)
            self._drop(g.prompt_id, g.attempt, reason, retryable=False)  # no gradient signal: never retried
            return
        self.ledger.finish(g.prompt_id)
        self._waiting.append(group)

    # -- training --------------------------------------------------------------
    def staleness(self, group: Group, trainer_version: int) -> int:
        v = group.oldest_version()
        return 0 if v is None else trainer_version - v

    def _plan(self, n_groups: int, version: int) -> tuple[list[Group], int]:
        items: list[Outstanding[Group]] = [Outstanding(g.seq, g.deadline, None) for g in self._open.values()]
        items += [Outstanding(int(g.metadata["seq"]), int(g.metadata["deadline"]), g) for g in self._waiting]
        return plan(items, n_groups, version, self.batch_groups, self.stride)

    def collect(self, n_groups: int, trainer_version: int) -> list[Group]:
        """Take up to `n_groups` finished groups for the batch of `trainer_version`.

        'arrival' / 'budget': the oldest finished, dropping stale ones on the way ('arrival'),
        so it returns nothing only when nothing fresh is waiting. 'deadline': those the plan
        says to take now (it may take fewer and wait for a group due at this version). Call
        again with the rest of the batch as groups finish.
        """
        self.set_version(trainer_version)
        if self._last_collect is not None and trainer_version > self._last_collect:
            self.stride = trainer_version - self._last_collect
        self._last_collect = trainer_version
        out: list[Group] = []
        if self.schedule == "deadline":
            picked = self._plan(n_groups, trainer_version)[0]
            ids = {id(g) for g in picked}
            self._waiting = deque(g for g in self._waiting if id(g) not in ids)
            out = [g for g in picked if self._train_or_drop(g, trainer_version)]
        else:
            while self._waiting and len(out) < n_groups:
                g = self._waiting.popleft()
                if self._train_or_drop(g, trainer_version):
                    out.append(g)
        v, k = self._taken
        self._taken = (trainer_version, (k if v == trainer_version else 0) + len(out))
        self.totals["groups_trained"] += len(out)
        return out

    def _train_or_drop(self, g: Group, trainer_version: int) -> bool:
        """Hand a group to the trainer (True), or drop it as stale ('budget' never does)."""
        st = self.staleness(g, trainer_version)
        if self.max_staleness is not None and st > self.max_staleness and self.schedule != "budget":
            self._stale += 1
            self.totals["stale_groups_filtered"] += 1
            self.bias.dropped(g, "stale")
            self._drop(g.prompt_id, int(g.metadata["attempt"]), "stale", retryable=True)
            return False
        self.ledger.train(g.prompt_id, trainer_version)
        self._drawn_staleness.append(st)
        self.bias.trained(g)
        return True

    def step_metrics(self, trainer_version: int) -> dict[str, float]:
        """The metrics of one training step (counters since the previous call), then reset."""
        waiting = [self.staleness(g, trainer_version) for g in self._waiting]
        drawn = self._drawn_staleness
        m: dict[str, float] = {
            P + "queue_size": float(len(self._waiting)),
            P + "aborted_groups_filtered": float(self._aborted),
            P + "stale_groups_filtered": float(self._stale),
            P + "avg_staleness": sum(drawn) / len(drawn) if drawn else 0.0,
            P + "max_staleness": float(max(drawn)) if drawn else 0.0,
            P + "buffer_avg_staleness": sum(waiting) / len(waiting) if waiting else 0.0,
            P + "buffer_max_staleness": float(max(waiting)) if waiting else 0.0,
        }
        for reason, k in self._drops.items():
            m[f"rollout/dynamic_filter/drop_{reason}"] = float(k)
        m |= self.bias.step_metrics()
        self._aborted = self._stale = 0
        self._drops = Counter()
        self._drawn_staleness = []
        return m

    # -- checkpoint ------------------------------------------------------------
    def dump(self) -> dict[str, Any]:
        """JSON-able state: the ledger and the prompts it still needs. Generated data is not kept."""
        needed = {p for p in self._prompts if self.ledger.get(p).state in ("pending", "in_flight", "finished")}
        return {"ledger": self.ledger.dump(), "prompts": {p: self._prompts[p] for p in sorted(needed)},
                "totals": dict(self.totals), "bias": self.bias.dump()}

    def load(self, d: dict[str, Any]) -> None:
        """Restore a dump into this (fresh) buffer; in-flight and waiting prompts start again."""
        if self._open or self._waiting or self._running:
            raise BufferError("buffer: load() needs a fresh buffer (work is running or waiting)")
        self.ledger = Ledger.restore(d["ledger"])
        self._prompts = {str(k): dict(v) for k, v in d["prompts"].items()}
        self.totals = Counter({str(k): int(v) for k, v in d.get("totals", {}).items()})
        self.bias.load(d.get("bias", {}))
