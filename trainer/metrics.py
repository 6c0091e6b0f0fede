"""Step metrics accumulated over micro-batches and reduced over DP ranks.

Means are kept as (numerator, denominator) pairs and maxima separately, so the reduced
value is the exact global mean/max whatever the packing and sharding. Reduction packs
everything into one tensor per kind (one all-reduce for sums, one for maxima).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ReduceFn = Callable[[torch.Tensor], torch.Tensor]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class StepMetrics:
    def __init__(self) -> None:
        self._sums: dict[str, list[float]] = {}
        self._maxes: dict[str, float] = {}
        self._plain: set[str] = set()

    def add_mean(self, name: str, total: float | torch.Tensor, count: float | torch.Tensor) -> None:
        """Contribute `total` over `count` items to the mean `name`."""
        cur = self._sums.setdefault(name, [0.0, 0.0])
        cur[0] += float(total)
        cur[1] += float(count)

    def add_sum(self, name: str, value: float | torch.Tensor) -> None:
        """Contribute to a plain sum (e.g. a loss share; shares add up to the global loss)."""
        cur = self._sums.setdefault(name, [0.0, 0.0])
        cur[0] += float(value)
        self._plain.add(name)

    def add_max(self, name: str, value: float | torch.Tensor) -> None:
        v = float(value)
        self._maxes[name] = max(self._maxes.get(name, float("-inf")), v)

    def names(self) -> list[str]:
        return sorted(set(self._sums) | set(self._maxes))

    def reduce(
        self, sum_fn: ReduceFn = _same, max_fn: ReduceFn = _same, names: list[str] | None = None
    ) -> dict[str, float]:
        """Global values. Every rank must call with the same `names` (default: its own)."""
        keys = sorted(self._sums) if names is None else [n for n in names if not n.endswith("#max")]
        mkeys = (
            sorted(self._maxes) if names is None else [n[:-4] for n in names if n.endswith("#max")]
        )
        s = torch.tensor([self._sums.get(k, [0.0, 0.0]) for k in keys], dtype=torch.float64)
        m = torch.tensor([self._maxes.get(k, float("-inf")) for k in mkeys], dtype=torch.float64)
        if keys:
            s = sum_fn(s.reshape(-1)).reshape(-1, 2)
        if mkeys:
            m = max_fn(m)
        out: dict[str, float] = {}
        for i, k in enumerate(keys):
            num, den = float(s[i, 0]), float(s[i, 1])
            if k in self._plain:
                out[k] = num
            else:
                out[k] = num / den if den > 0 else 0.0
        for i, k in enumerate(mkeys):
            v = float(m[i])
            out[k] = v if v != float("-inf") else 0.0
        return out

    def key_set(self) -> list[str]:
        """Names as passed to `reduce(names=...)` (maxima tagged with '#max')."""
        return sorted(self._sums) + sorted(f"{k}#max" for k in self._maxes)
