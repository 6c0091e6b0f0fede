"""The transfer plan of a sharded weight sync: which trainer rank sends which bytes where.

No rank holds the whole model. Each trainer rank owns a slice of every parameter (FSDP2:
rows [a, b) of dim 0); each parameter holds one or more HF tensors (a fused q/k/v or
gate/up projection: row ranges; stacked experts: one expert per index of dim 0). The plan
intersects the two and says, for every (trainer rank, HF tensor slice):

- where its bytes lie in the rank's *send buffer* (the rank's own slices, cast to the wire
  dtype, back to back in engine order: the only copy a rank makes, and only of what it owns);
- which engine layout group receives it, and where its bytes land in that group's flat
  plan (transport/bulk/flat.py: the engine's staging slots, HF order).

It is computed once from both sides' layouts (`TrainerLayout`, `EngineLayout`) and rebuilt
when either changes (its `digest` names it). Everything here is plain data: no torch
collectives, no sockets; `transport/bulk/coordinator.py` moves the bytes it describes.

Layouts covered:
- trainer: FSDP2 dim-0 shards (`fsdp_rows`), replicated parameters (owned by rank 0), and
  any layout that gives each rank row ranges of HF tensors (`ParamLayout.owned`): that is
  also the form of a Megatron TP column-parallel slice (fused QKV per query group: one row
  range of q, k and v per group) and of EP (whole experts). Megatron row-parallel slices
  (dim 1) are columns of an HF tensor and do not fit a byte range; see docs/sync_at_scale.md.
- engine: a group of engines holding the same rows of each HF tensor. Whole-model engines
  are one group holding every row; a TP engine split on dim 0 is one group per TP rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from miles.core.errors import SyncError
from miles.transport.bulk.base import dtype_of
from miles.transport.bulk.flat import FlatPlan

Rows = tuple[int, int]


def fsdp_rows(n: int, rank: int, world: int) -> Rows:
    """Rows [a, b) of an n-row dim 0 that FSDP2's Shard(0) gives `rank` (torch.chunk: ceil(n/world)
    rows each, the last ranks possibly short or empty)."""
    per = -(-n // world)
    return min(rank * per, n), min((rank + 1) * per, n)


@dataclass(frozen=True)
class HFPart:
    """One HF tensor inside a trainer parameter: `param[expert][rows]` (expert None: no expert axis)."""

    hf_name: str
    expert: int | None
    rows: Rows  # of the parameter's row axis (dim 0, or dim 1 under an expert axis)
    row_shape: tuple[int, ...]  # shape of one row (the HF tensor's trailing dims)


@dataclass(frozen=True)
class ParamLayout:
    """A trainer parameter: its full shape, the HF tensors it holds, and who owns which dim-0 rows."""

    name: str
    shape: tuple[int, ...]
    parts: tuple[HFPart, ...]
    owned: tuple[Rows, ...]  # per trainer rank: rows [a, b) of dim 0 (a == b: nothing)

    def __post_init__(self) -> None:
        pos = 0
        for a, b in self.owned:
            if a != b and a != pos:
                raise SyncError(f"parameter {self.name!r}: rank row ranges {self.owned} do not tile dim 0")
            pos = max(pos, b)
        if self.shape and pos != self.shape[0]:
            raise SyncError(f"parameter {self.name!r}: rank row ranges {self.owned} cover {pos} of "
                            f"{self.shape[0]} rows")


@dataclass(frozen=True)
class TrainerLayout:
    params: tuple[ParamLayout, ...]
    world: int
    dtype: str  # the wire dtype every rank casts its slices to

    @classmethod
    def fsdp(cls, params: Iterable[tuple[str, tuple[int, ...], Sequence[HFPart]]], world: int,
             dtype: str) -> TrainerLayout:
        """FSDP2: every parameter sharded on dim 0 across `world` ranks."""
        out = []
        for name, shape, parts in params:
            n = shape[0] if shape else 1
            out.append(ParamLayout(name, tuple(shape), tuple(parts), tuple(fsdp_rows(n, r, world)
                                                                             for r in range(world))))
        return cls(tuple(out), world, dtype)

    def hf_tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, full shape) in trainer order: the order of a whole-model engine's plan."""
        return [(p.hf_name, (p.rows[1] - p.rows[0], *p.row_shape)) for prm in self.params for p in prm.parts]


@dataclass(frozen=True)
class EngineLayout:
    """Engines that hold the same rows of each HF tensor, laid out as `plan` (HF order).

    `rows[name]` is the [a, b) row range this group holds of HF tensor `name` (absent: all of
    it); the plan's shape of `name` is that slice's shape."""

    plan: FlatPlan
    rows: dict[str, Rows] = field(default_factory=dict)

    @classmethod
    def whole(cls, tensors: Sequence[tuple[str, tuple[int, ...]]], dtype: str) -> EngineLayout:
        return cls.split(tensors, dtype, {})

    @classmethod
    def split(cls, tensors: Sequence[tuple[str, tuple[int, ...]]], dtype: str,
              rows: dict[str, Rows]) -> EngineLayout:
        """A group holding rows `rows[name]` of each tensor (all rows where absent), in this order."""
        item = dtype_of(dtype).itemsize
        names, shapes, offsets, pos = [], [], [], 0
        for name, shape in tensors:
            a, b = rows.get(name, (0, shape[0] if shape else 1))
            held = (b - a, *shape[1:]) if shape else ()
            names.append(name)
            shapes.append(held)
            offsets.append(pos)
            n = item
            for s in held:
                n *= s
            pos += n
        plan = FlatPlan(tuple(names), tuple([dtype] * len(names)), tuple(shapes), tuple(offsets), pos)
        return cls(plan, dict(rows))


@dataclass(frozen=True)
class Piece:
    """Bytes one trainer rank owns of one HF tensor, bound for one engine group."""

    rank: int
    group: int
    hf_name: str
    rows: Rows  # of the HF tensor
    param: str
    expert: int | None  # the expert index within the parameter (global)
    param_rows: Rows  # rows of the parameter's row axis these bytes are
    src: int  # byte offset in the rank's send buffer
    dst: int  # byte offset in the group's flat plan
    nbytes: int


@dataclass(frozen=True)
class ShardBucket:
    """One bucket of one rank for one engine group: (src offset, dst offset, bytes) runs."""

    runs: tuple[tuple[int, int, int], ...]
    nbytes: int

    @property
    def ranges(self) -> list[list[int]]:
        """Destination byte ranges [lo, hi), in send order (what the engine lands)."""
        return [[d, d + n] for _, d, n in self.runs]

    def contiguous_src(self) -> tuple[int, int] | None:
        """[lo, hi) of the send buffer when the runs lie back to back there (sent with no pack copy)."""
        pos = self.runs[0][0]
        for s, _, n in self.runs:
            if s != pos:
                return None
            pos += n
        return self.runs[0][0], pos


class TransferPlan:
    """Every (trainer rank, HF tensor slice) -> (engine group, byte range), from both layouts."""

    def __init__(self, trainer: TrainerLayout, engines: Sequence[EngineLayout]) -> None:
        if not engines:
            raise SyncError("transfer plan: no engine layout")
        self.trainer, self.engines = trainer, tuple(engines)
        item = dtype_of(trainer.dtype).itemsize
        for g, eng in enumerate(self.engines):
            if set(eng.plan.dtypes) != {trainer.dtype}:
                raise SyncError(f"transfer plan: engine group {g} lands {sorted(set(eng.plan.dtypes))}, the "
                                f"trainer sends {trainer.dtype}")
        index = [dict(zip(e.plan.names, range(len(e.plan.names)), strict=True)) for e in self.engines]
        # Send-buffer order: per rank, its slices in the first group's plan order, so a whole-model
        # engine's bucket is one contiguous run of the send buffer.
        raw: list[list[tuple[int, str, int | None, Rows, Rows, str, int]]] = [[] for _ in range(trainer.world)]
        hf_seen: set[str] = set()
        for prm in trainer.params:
            for part in prm.parts:
                if part.hf_name in hf_seen:
                    raise SyncError(f"transfer plan: HF tensor {part.hf_name!r} is held by two parameters")
                hf_seen.add(part.hf_name)
                row_bytes = item
                for s in part.row_shape:
                    row_bytes *= s
                for r, (a, b) in enumerate(prm.owned):
                    if part.expert is not None:  # dim 0 is the expert axis: whole experts per rank
                        if not a <= part.expert < b:
                            continue
                        hf_rows, prows = (0, part.rows[1] - part.rows[0]), part.rows
                    else:
                        lo, hi = max(a, part.rows[0]), min(b, part.rows[1])
                        if lo >= hi:
                            continue
                        hf_rows, prows = (lo - part.rows[0], hi - part.rows[0]), (lo, hi)
                    raw[r].append((row_bytes, part.hf_name, part.expert, hf_rows, prows, prm.name, 0))
        for g, eng in enumerate(self.engines):
            missing = set(eng.plan.names) - hf_seen
            if missing:
                raise SyncError(f"transfer plan: engine group {g} holds {len(missing)} tensor(s) no trainer "
                                f"parameter has, e.g. {sorted(missing)[:3]}")
        self.send_bytes: list[int] = []
        self.pieces: list[list[Piece]] = []
        for r in range(trainer.world):
            first = index[0]
            raw[r].sort(key=lambda x: (first.get(x[1], len(first)), x[3][0]))
            pieces, pos = [], 0
            for row_bytes, hf, expert, hf_rows, prows, pname, _ in raw[r]:
                n = (hf_rows[1] - hf_rows[0]) * row_bytes
                for g, eng in enumerate(self.engines):
                    i = index[g].get(hf)
                    if i is None:
                        continue
                    ga, gb = eng.rows.get(hf, (0, 1 << 62))  # the rows this group holds
                    lo, hi = max(hf_rows[0], ga), min(hf_rows[1], gb)
                    if lo >= hi:
                        continue
                    pieces.append(Piece(r, g, hf, (lo, hi), pname, expert,
                                        (prows[0] + lo - hf_rows[0], prows[0] + hi - hf_rows[0]),
                                        pos + (lo - hf_rows[0]) * row_bytes,
                                        eng.plan.offsets[i] + (lo - ga) * row_bytes,
                                        (hi - lo) * row_bytes))
                pos += n
            self.pieces.append(pieces)
            self.send_bytes.append(pos)
        self._check_cover()
        h = xxhash.xxh64(repr((trainer, [(e.plan.digest, sorted(e.rows.items())) for e in self.engines])).encode())
        self.digest = h.hexdigest()

    def _check_cover(self) -> None:
        """Every byte of every engine group's plan is sent by exactly one rank."""
        for g, eng in enumerate(self.engines):
            spans = sorted((p.dst, p.dst + p.nbytes) for ps in self.pieces for p in ps if p.group == g)
            pos = 0
            for lo, hi in spans:
                if lo != pos:
                    raise SyncError(f"transfer plan: engine group {g} bytes [{pos}, {lo}) are "
                                    + ("sent twice" if lo < pos else "sent by no rank"))
                pos = hi
            if pos != eng.plan.nbytes:
                raise SyncError(f"transfer plan: engine group {g} receives {pos} of {eng.plan.nbytes} bytes")

    def buckets(self, rank: int, group: int, bucket_bytes: int) -> list[ShardBucket]:
        """Rank `rank`'s pieces for engine group `group`, cut into buckets of at most `bucket_bytes`
        (a piece larger than a bucket spans several; byte ranges need no element alignment).
        Runs adjacent on both sides are merged: a whole-model bucket is one source run."""
        if bucket_bytes <= 0:
            raise SyncError(f"bucket size must be positive, got {bucket_bytes} bytes")
        out: list[ShardBucket] = []
        runs: list[list[int]] = []
        size = 0
        for p in self.pieces[rank]:
            if p.group != group:
                continue
            s, d, n = p.src, p.dst, p.nbytes
            while n:
                take = min(n, bucket_bytes - size)
                if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
                    runs[-1][2] += take
                else:
                    runs.append([s, d, take])
                s, d, n, size = s + take, d + take, n - take, size + take
                if size == bucket_bytes:
                    out.append(ShardBucket(tuple(tuple(x) for x in runs), size))  # type: ignore[misc]
                    runs, size = [], 0
        if runs:
            out.append(ShardBucket(tuple(tuple(x) for x in runs), size))  # type: ignore[misc]
        return out


@dataclass
class ShardExport:
    """What one trainer rank pushes: its send buffer (uint8, the plan's `send_bytes[rank]`) and the plan."""

    buffer: Any  # torch.Tensor (uint8, 1-D); typed loosely so the plan stays torch-free to read
    plan: TransferPlan
    rank: int
