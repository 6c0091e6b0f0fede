"""The trainer's flat export buffer: its HF weights gathered into one persistent buffer.

A weight sync of a flat export (weightsync/flat.py) moves byte ranges instead of
tensors: the plan goes to the engines once, and no per-tensor work is left on either
side per version. The buffer is allocated at the first export, in HF order and the sync
dtype, and refilled in place by every later one (one copy per tensor, as the gather
produces it); a different tensor list (names, shapes) builds it afresh.

`ShardExportBuffer` is the sharded export (ShardedWeightSync): each rank keeps only its own
slices, in the order of the transfer plan (weightsync/shard_plan.py), and sends them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from miles.core.errors import TrainerError
from miles.models.config import ModelSpec
from miles.models.hf_io import hf_param_views
from miles.models.hf_names import hf_param_slices
from miles.weightsync.flat import FlatWeights
from miles.weightsync.shard_plan import (
    EngineLayout,
    HFPart,
    ShardExport,
    TrainerLayout,
    TransferPlan,
)


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


def hf_parts(spec: ModelSpec, name: str, shape: tuple[int, ...]) -> list[HFPart]:
    """The HF tensors inside parameter `name` of full shape `shape`, as plan parts."""
    out = []
    for s in hf_param_slices(spec, name, shape):
        inner = shape[1:] if s.expert is not None else shape
        n = inner[0] if inner else 1
        a, b, _ = s.rows.indices(n)
        out.append(HFPart(s.hf_name, s.expert, (a, b), tuple(inner[1:])))
    return out


class ShardExportBuffer:
    """One trainer rank's sharded export: its own slices of every HF tensor, cast to the wire
    dtype, back to back in the transfer plan's order (weightsync/shard_plan.py).

    Nothing is gathered: the buffer is this rank's shard and nothing more (the cast is the one
    copy). The plan and the (parameter slice -> buffer view) pairs are built once; every later
    export is one multi-tensor copy with the cast. They are rebuilt when a parameter moves or
    the dtype changes."""

    def __init__(self) -> None:
        self.export: ShardExport | None = None
        self._key: Any = None
        self._srcs: list[torch.Tensor] = []
        self._dsts: list[torch.Tensor] = []

    @torch.no_grad()
    def fill(self, spec: ModelSpec, params: list[tuple[str, torch.Tensor, tuple[int, ...]]], rank: int,
             world: int, dtype: torch.dtype | None = None) -> ShardExport:
        """`params`: (name, this rank's local dim-0 shard, the parameter's full shape), every rank
        in the same order."""
        dt = dtype or (params[0][1].dtype if params else torch.float32)
        key = (dt, rank, world, tuple((n, t.data_ptr(), t.dtype, tuple(t.shape), full) for n, t, full in params))
        if key != self._key or self.export is None:
            self._build(spec, params, rank, world, dt)
            self._key = key
        torch._foreach_copy_(self._dsts, self._srcs)
        assert self.export is not None
        return self.export

    def _build(self, spec: ModelSpec, params: list[tuple[str, torch.Tensor, tuple[int, ...]]], rank: int,
               world: int, dt: torch.dtype) -> None:
        wire = str(dt).removeprefix("torch.")
        layout = TrainerLayout.fsdp([(n, full, hf_parts(spec, n, full)) for n, _, full in params], world, wire)
        plan = TransferPlan(layout, [EngineLayout.whole(layout.hf_tensors(), wire)])
        local = {n: t for n, t, _ in params}
        owned = {p.name: p.owned[rank] for p in layout.params}
        for prm in layout.params:
            a, b = owned[prm.name]
            got = tuple(local[prm.name].shape)
            want = (b - a, *prm.shape[1:]) if prm.shape else ()
            if got != want:
                raise TrainerError(f"sharded export: parameter {prm.name!r} on rank {rank} holds shape {got}, an "
                                   f"FSDP2 dim-0 shard of {prm.shape} over {world} ranks is {want}")
        self.export = None  # the old buffer goes before the new one is allocated
        buf = torch.empty(plan.send_bytes[rank], dtype=torch.uint8, device=params[0][1].device)
        srcs, dsts = [], []
        for p in plan.pieces[rank]:
            if p.group != 0:
                continue
            t = local[p.param]
            a = owned[p.param][0]
            src = t[p.expert - a][p.param_rows[0]:p.param_rows[1]] if p.expert is not None else \
                t[p.param_rows[0] - a:p.param_rows[1] - a]
            srcs.append(src)
            dsts.append(buf[p.src:p.src + p.nbytes].view(dt).view(src.shape))
        self._srcs, self._dsts = srcs, dsts
        self.export = ShardExport(buf, plan, rank)
