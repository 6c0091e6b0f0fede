"""Measures of what the trainer sees against what was generated (the short-rollout bias).

- `len_ratio`: mean response length of the samples handed to the trainer divided by
  that of every sample generated (trained or not), both over the last `window` steps.
  1.0 = no bias; asynchronous schedules that train in arrival order and drop stale
  groups give < 1 on long-tailed workloads, because the groups dropped are the long ones.
- `untrained_share`: response tokens of groups dropped (never trained on) divided by
  every response token generated, since the start of the run, in total and by drop
  reason (`untrained_share/<reason>`: stale, failed, or a filter's reason). Work still
  generating or waiting at a step is not counted as untrained yet.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

from miles.rollout.types import Group, Sample

P = "rollout/fully_async/"


def _tokens(samples: list[Sample]) -> int:
    return sum(len(s.response_ids) for s in samples)


class BiasMeter:
    def __init__(self, window: int = 8) -> None:
        if window < 1:
            raise ValueError(f"bias window must be >= 1 step, got {window}")
        self._steps: deque[tuple[int, int, int, int]] = deque(maxlen=window)
        self._cur = [0, 0, 0, 0]  # trained tokens, trained samples, generated tokens, generated samples
        self.generated_tokens = 0
        self.untrained: Counter[str] = Counter()  # response tokens dropped, by reason

    def generated(self, samples: list[Sample]) -> None:
        t = _tokens(samples)
        self._cur[2] += t
        self._cur[3] += len(samples)
        self.generated_tokens += t

    def trained(self, group: Group) -> None:
        self._cur[0] += _tokens(group.samples)
        self._cur[1] += len(group.samples)

    def dropped(self, group: Group, reason: str) -> None:
        self.untrained[reason] += _tokens(group.samples)

    def step_metrics(self) -> dict[str, float]:
        """Close the current step; the window's ratio and the run's untrained shares."""
        self._steps.append((self._cur[0], self._cur[1], self._cur[2], self._cur[3]))
        self._cur = [0, 0, 0, 0]
        tt, ts, gt, gs = (sum(s[i] for s in self._steps) for i in range(4))
        ratio = (tt / ts) / (gt / gs) if ts and gs and gt else 1.0
        gen = max(1, self.generated_tokens)
        m = {P + "len_ratio": ratio, P + "untrained_share": sum(self.untrained.values()) / gen}
        for reason in sorted({"stale", "failed", *self.untrained}):
            m[f"{P}untrained_share/{reason}"] = self.untrained[reason] / gen
        return m

    def dump(self) -> dict[str, Any]:
        return {"generated_tokens": self.generated_tokens, "untrained": dict(self.untrained)}

    def load(self, d: dict[str, Any]) -> None:
        self.generated_tokens = int(d.get("generated_tokens", 0))
        self.untrained = Counter({str(k): int(v) for k, v in d.get("untrained", {}).items()})
