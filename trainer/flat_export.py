"""The trainer's flat export buffer: its HF weights gathered into one persistent buffer.

A weight sync of a flat export (transport/bulk/flat.py) moves byte ranges instead of
tensors: the plan goes to the engines once, and no per-tensor work is left on either
side per version. The buffer is allocated at the first export, in HF order and the sync
dtype, and refilled in place by every later one (one copy per tensor, as the gather
produces it); a different tensor list (names, shapes) builds it afresh.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from miles.models.config import ModelSpec
from miles.models.hf_io import hf_param_views
from miles.transport.bulk.flat import FlatWeights


class FlatExportBuffer:
    def __init__(self) -> None:
        self.weights: FlatWeights | None = None
        self._views: list[tuple[str, torch.Tensor]] = []
        self._local_key: Any = None  # what the (source, buffer) view pairs below were built for
        self._srcs: list[torch.Tensor] = []
        self._dsts: list[torch.Tensor] = []

    @torch.no_grad()
    def fill_local(self, spec: ModelSpec, params: list[tuple[str, torch.Tensor]],
                   dtype: torch.dtype | None = None) -> FlatWeights:
        """Refill from parameters held whole on this rank (one trainer rank: no gather).

        The (HF view of a parameter -> view of the buffer) pairs are built once; every later
        export is one multi-tensor copy with the cast, instead of Python work per tensor
        (~20 us each: ~50 ms for a 2,400-tensor MoE). The pairs are rebuilt when a parameter
        moves (offload, a new optimizer layout) or the dtype changes."""
        key = (dtype, tuple((n, t.data_ptr(), t.dtype, tuple(t.shape), t.device) for n, t in params))
        if key == self._local_key and self.weights is not None:
            torch._foreach_copy_(self._dsts, self._srcs)
            return self.weights
        pairs = [(hn, v) for n, t in params for hn, v in hf_param_views(spec, n, t)]
        weights = self.fill(iter(pairs), dtype)
        views = dict(self._views)
        self._srcs, self._dsts = [v for _, v in pairs], [views[n] for n, _ in pairs]
        self._local_key = key
        return weights

    @torch.no_grad()
    def fill(self, named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> FlatWeights:
        """Copy the (name, full tensor) stream into the buffer (consumed one tensor at a time)."""
        it = iter(named)
        views, n = self._views, 0
        for name, t in it:
            if n < len(views) and views[n][0] == name and views[n][1].shape == t.shape:
                views[n][1].copy_(t)
                n += 1
                continue
            # The tensor list changed: a new buffer, from what this export filled so far on
            # (the old buffer lives until the new one is filled).
            return self._build([*views[:n], (name, t), *it], dtype)
        if self.weights is None or n != len(views):
            return self._build(views[:n], dtype)
        return self.weights

    def _build(self, items: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> FlatWeights:
        if not items:
            raise ValueError("flat export: the trainer exported no tensors")
        dt = dtype or items[0][1].dtype
        mixed = {t.dtype for _, t in items} - {dt} if dtype is None else set()
        if mixed:
            raise ValueError(f"flat export: tensors of several dtypes ({dt} and {sorted(map(str, mixed))}); "
                             "set sync.dtype to move them in one")
        self.weights = FlatWeights.copy_of(items, dt)
        self._views = list(self.weights)
        return self.weights
