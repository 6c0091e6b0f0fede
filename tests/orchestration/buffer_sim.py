"""A discrete-time driver for the real `RolloutBuffer`: an engine model and a trainer model.

Only the timing is modelled; admission, ordering, staleness drops and the bias metrics
are the buffer's own. Each generating trajectory gets one token per tick (continuous
batching at a fixed step time) up to its length, and its tokens carry the weight
version of the tick that sampled them (an in-place update mixes versions; the oldest
counts for staleness). Lengths are long-tailed per prompt: a log-normal budget seeded
by the prompt, as in rollout/envs/long_tail.py, with a small per-sample spread. The
trainer collects a batch piece by piece like the rollout actor, then trains for
`train_ticks` and publishes the next version (`version_stride` versions later: a trainer
may publish more than one version per step).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from miles.rollout.buffer import P, RolloutBuffer, Schedule, Work
from miles.rollout.types import Group, Sample


@dataclass
class SimRun:
    steps: int
    generated_samples: int
    stale_groups: int
    trained_len: float
    generated_len: float
    max_staleness: float
    ticks: int
    metrics: list[dict[str, float]] = field(default_factory=list)

    @property
    def len_ratio(self) -> float:
        return self.trained_len / self.generated_len


def budget(prompt_index: int, sample_index: int, median: float, sigma: float, max_len: int) -> int:
    base = random.Random(prompt_index).lognormvariate(math.log(median), sigma)
    x = base * random.Random(prompt_index * 131 + sample_index + 1).lognormvariate(0.0, 0.2)
    return max(1, min(max_len, round(x)))


def simulate(schedule: Schedule, admission_control: bool = False, steps: int = 30, capacity: int = 32,
             n: int = 4, batch_groups: int = 4, max_staleness: int = 1, train_ticks: int = 20,
             median: float = 8.0, sigma: float = 1.0, max_len: int = 120, version_stride: int = 1) -> SimRun:
    counter = iter(range(10**9))
    buf = RolloutBuffer(capacity, n, max_staleness, admission_control=admission_control,
                        batch_groups=batch_groups, schedule=schedule,
                        prompt_source=lambda: {"id": f"p{(i := next(counter))}", "index": i})
    version, tick, train_left = 0, 0, 0
    # work -> (tokens still to sample, versions of the tokens sampled so far)
    running: dict[int, tuple[Work, int, list[int]]] = {}
    batch: list[Group] = []
    rows: list[dict[str, float]] = []
    trained_tokens = trained_samples = gen_tokens = gen_samples = 0

    def start(works: list[Work]) -> None:
        for w in works:
            length = budget(int(w.prompt["index"]), w.sample_index, median, sigma, max_len)
            running[id(w)] = (w, length, [])

    start(buf.fill())
    while len(rows) < steps:
        tick += 1
        finished = []
        for key, (w, left, vs) in running.items():
            vs.append(version)
            if left == 1:
                finished.append(key)
            else:
                running[key] = (w, left - 1, vs)
        for key in finished:
            w, _, vs = running.pop(key)
            gen_tokens += len(vs)
            gen_samples += 1
            s = Sample(prompt_ids=[1], response_ids=[0] * len(vs), loss_mask=[1] * len(vs),
                       rollout_logprobs=[-0.5] * len(vs), versions=vs, reward=float(w.sample_index % 2))
            start(buf.finish(w, [s]))
        if train_left:
            train_left -= 1
            if not train_left:  # the update lands: a new version, new admissions
                version += version_stride
                buf.set_version(version)
                start(buf.fill())
            continue
        batch += buf.collect(batch_groups - len(batch), version)
        start(buf.fill())
        if len(batch) == batch_groups:
            trained_samples += sum(len(g) for g in batch)
            trained_tokens += sum(len(s.response_ids) for g in batch for s in g.samples)
            rows.append(buf.step_metrics(version))
            batch, train_left = [], train_ticks
    return SimRun(steps, gen_samples, int(sum(r[P + "stale_groups_filtered"] for r in rows)),
                  trained_tokens / trained_samples, gen_tokens / gen_samples,
                  max(r[P + "max_staleness"] for r in rows), tick, rows)
