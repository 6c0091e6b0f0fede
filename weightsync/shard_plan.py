"""The transfer plan of a sharded weight sync: which trainer rank sends which bytes where.

No rank holds the whole model. Each trainer rank owns a slice of every parameter (FSDP2:
rows [a, b) of dim 0; Megatron row-parallel layers: columns [a, b) of dim 1); each parameter
holds one or more HF tensors, each as one or more row segments (a fused gate/up projection:
two row ranges; Megatron's fused QKV: one segment of q, k and v per query group; stacked
experts: one expert per index of dim 0). The plan intersects the two and says, for every
(trainer rank, HF tensor slice):

- where its bytes lie in the rank's *send buffer* (the rank's own slices, cast to the wire
  dtype, back to back in engine order: the only copy a rank makes, and only of what it owns);
- which engine layout group receives it, and where its bytes land in that group's flat
  plan (weightsync/flat.py: the engine's staging slots, HF order). A column slice
  [rows, c0:c1) is one contiguous block in the send buffer and a strided set of row
  segments on the engine (`Piece.stride`): each HF row gets bytes [c0, c1) of that row.

It is computed once from both sides' layouts (`TrainerLayout`, `EngineLayout`) and rebuilt
when either changes (its `digest` names it). Everything here is plain data: no torch
collectives, no sockets; `weightsync/coordinator.py` moves the bytes it describes.

Layouts covered:
- trainer: FSDP2 dim-0 shards (`TrainerLayout.fsdp`), replicated parameters (owned by one
  rank), and Megatron TP/EP/PP (`weightsync/shard_megatron.py`: column-parallel fused
  QKV and gate/up as row segments, row-parallel `linear_proj`/`linear_fc2` as column
  slices, vocab-parallel embedding rows, whole experts per EP rank, optionally TP-split).
- engine: a group of engines holding the same slice of each HF tensor. Whole-model engines
  are one group; a TP engine is one group per TP rank, holding rows of column-parallel
  tensors and columns of row-parallel ones (`EngineLayout.split`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from miles.core.errors import SyncError
from miles.transport.bulk.base import dtype_of
from miles.weightsync.flat import FlatPlan

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
    at: int = 0  # the HF row where `rows` begin (an HF tensor held as several segments)
    hf_rows: int = 0  # the HF tensor's row count (0: just `rows`, the tensor is one segment)

    @property
    def total_rows(self) -> int:
        return self.hf_rows or self.rows[1] - self.rows[0]


@dataclass(frozen=True)
class ParamLayout:
    """A trainer parameter: its full shape, the HF tensors it holds, and who owns which slice.

    `owned[r]` is the [a, b) range of dim `dim` rank r holds: dim 0 (rows: FSDP2, Megatron
    column-parallel, vocab-parallel) or dim 1 (columns: Megatron row-parallel; every part then
    spans whole rows, the rank holds all of them, and its local tensor is [rows, b - a])."""

    name: str
    shape: tuple[int, ...]
    parts: tuple[HFPart, ...]
    owned: tuple[Rows, ...]  # per trainer rank: [a, b) of dim `dim` (a == b: nothing)
    dim: int = 0
    # the dtype this parameter's bytes travel and land in; "": the trainer layout's wire dtype (a
    # one-rank flat export of several dtypes, weightsync/one_rank.py, names each tensor's own)
    dtype: str = ""

    def __post_init__(self) -> None:
        if self.dim not in (0, 1) or (self.dim == 1 and len(self.shape) < 2):
            raise SyncError(f"parameter {self.name!r} of shape {self.shape}: cannot be split on dim {self.dim}")
        if self.dim == 1 and any(p.expert is not None for p in self.parts):
            raise SyncError(f"parameter {self.name!r}: a column split under an expert axis is not a plan layout "
                            "(give each expert its own parameter)")
        pos = 0
        for a, b in self.owned:
            if a != b and a != pos:
                raise SyncError(f"parameter {self.name!r}: rank ranges {self.owned} do not tile dim {self.dim}")
            pos = max(pos, b)
        if self.shape and pos != self.shape[self.dim]:
            raise SyncError(f"parameter {self.name!r}: rank ranges {self.owned} cover {pos} of "
                            f"{self.shape[self.dim]} along dim {self.dim}")


@dataclass(frozen=True)
class TrainerLayout:
    params: tuple[ParamLayout, ...]
    world: int
    dtype: str  # the wire dtype every rank casts its slices to (a parameter may name its own)

    def dtype_of(self, prm: ParamLayout) -> str:
        return prm.dtype or self.dtype

    @property
    def word(self) -> int:
        """Bytes of the smallest element any parameter travels as (the unit a delta compares)."""
        return min(dtype_of(d).itemsize for d in {self.dtype, *(p.dtype for p in self.params if p.dtype)})

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
        """(HF name, full shape) in trainer order (first segment): the order of a whole-model engine's plan."""
        out: dict[str, tuple[int, ...]] = {}
        for prm in self.params:
            for p in prm.parts:
                out.setdefault(p.hf_name, (p.total_rows, *p.row_shape))
        return list(out.items())


@dataclass(frozen=True)
class EngineLayout:
    """Engines that hold the same slice of each HF tensor, laid out as `plan` (HF order).

    `rows[name]` is the [a, b) row range this group holds of HF tensor `name`, `cols[name]` the
    [c0, c1) range of its dim 1 (absent: all); the plan's shape of `name` is that slice's shape.
    A TP engine is one group per TP rank: column-parallel tensors split by rows, row-parallel
    ones (`o_proj`, `down_proj`) by columns, replicated ones whole in every group."""

    plan: FlatPlan
    rows: dict[str, Rows] = field(default_factory=dict)
    cols: dict[str, Rows] = field(default_factory=dict)

    @classmethod
    def whole(cls, tensors: Sequence[tuple[str, tuple[int, ...]]], dtype: str) -> EngineLayout:
        return cls.split(tensors, dtype, {})

    @classmethod
    def split(cls, tensors: Sequence[tuple[str, tuple[int, ...]]], dtype: str,
              rows: dict[str, Rows], cols: dict[str, Rows] | None = None) -> EngineLayout:
        """A group holding rows `rows[name]` and columns `cols[name]` of each tensor (all where
        absent), in this order."""
        item = dtype_of(dtype).itemsize
        cols = cols or {}
        names, shapes, offsets, pos = [], [], [], 0
        for name, shape in tensors:
            a, b = rows.get(name, (0, shape[0] if shape else 1))
            held = (b - a, *shape[1:]) if shape else ()
            if name in cols:
                c0, c1 = cols[name]
                if len(shape) < 2 or not 0 <= c0 < c1 <= shape[1]:
                    raise SyncError(f"engine layout: columns [{c0}, {c1}) do not fit {name!r} of shape {shape}")
                held = (b - a, c1 - c0, *shape[2:])
            names.append(name)
            shapes.append(held)
            offsets.append(pos)
            n = item
            for s in held:
                n *= s
            pos += n
        plan = FlatPlan(tuple(names), tuple([dtype] * len(names)), tuple(shapes), tuple(offsets), pos)
        return cls(plan, dict(rows), dict(cols))


@dataclass(frozen=True)
class Piece:
    """Bytes one trainer rank owns of one HF tensor, bound for one engine group.

    `stride` 0: one contiguous run (src, dst, nbytes). Otherwise a column block of `width`
    bytes per row: row i lies at `src + i * src_stride` in the send buffer (`src_stride` 0:
    rows back to back, the rank's [rows, cols] slice) and lands at `dst + i * stride` (the
    engine slot's row length in bytes)."""

    rank: int
    group: int
    hf_name: str
    rows: Rows  # of the HF tensor
    param: str
    expert: int | None  # the expert index within the parameter (global)
    param_rows: Rows  # rows of the parameter's row axis these bytes are
    src: int  # byte offset in the rank's send buffer
    dst: int  # byte offset in the group's flat plan (of the first row's first byte)
    nbytes: int
    cols: Rows | None = None  # columns [c0, c1) of dim 1 (a column block), None: whole rows
    stride: int = 0
    src_stride: int = 0

    @property
    def width(self) -> int:
        """Bytes per landed run: a row's column span, or the whole piece."""
        return self.nbytes // (self.rows[1] - self.rows[0]) if self.stride else self.nbytes

    def runs(self) -> Iterator[tuple[int, int, int]]:
        """(src, dst, bytes) runs: one, or one per row of a column block."""
        if not self.stride:
            yield self.src, self.dst, self.nbytes
            return
        w = self.width
        step = self.src_stride or w
        for i in range(self.rows[1] - self.rows[0]):
            yield self.src + i * step, self.dst + i * self.stride, w


@dataclass(frozen=True)
class SendSlice:
    """One slice of one parameter a rank copies into its send buffer (the packing's unit):
    `param[expert][param_rows]` (with `cols`: `[:, cols]`, the rank's whole local width)."""

    param: str
    expert: int | None
    param_rows: Rows
    cols: Rows | None
    src: int
    nbytes: int


@dataclass(frozen=True)
class ShardBucket:
    """One bucket of one rank for one engine group: (src offset, dst offset, bytes) runs."""

    runs: tuple[tuple[int, int, int], ...]
    nbytes: int
    block_rows: tuple[bool, ...] = ()  # per run: a row of a column block (landed strided with its neighbours)

    @functools.cached_property
    def ranges(self) -> list[list[int]]:
        """Destination byte ranges in send order (what the engine lands): [lo, hi), or
        [lo, width, stride, count] for `count` runs of `width` bytes `stride` apart (a column
        block's rows: one entry, landed as one strided copy, instead of one range per row)."""
        out: list[list[int]] = []
        prev = False
        for i, (_, d, n) in enumerate(self.runs):
            row = bool(self.block_rows) and self.block_rows[i]
            last = out[-1] if out and prev and row else None
            if last is not None and len(last) == 4 and last[1] == n and d == last[0] + last[2] * last[3]:
                last[3] += 1
            elif last is not None and len(last) == 2 and last[1] - last[0] == n and d > last[1]:
                out[-1] = [last[0], n, d - last[0], 2]
            elif out and len(out[-1]) == 2 and out[-1][1] == d:  # back to back on the engine: one range
                out[-1][1] = d + n
            else:
                out.append([d, d + n])
            prev = row
        return out

    def contiguous_src(self) -> tuple[int, int] | None:
        """[lo, hi) of the send buffer when the runs lie back to back there (sent with no pack copy)."""
        return self._src_span

    @functools.cached_property
    def _src_span(self) -> tuple[int, int] | None:  # computed once per bucket, not per push
        pos = self.runs[0][0]
        for s, _, n in self.runs:
            if s != pos:
                return None
            pos += n
        return self.runs[0][0], pos


@dataclass(frozen=True)
class _Slice:
    """A rank's slice of one HF tensor segment before it is placed (internal to the plan)."""

    hf: str
    expert: int | None
    hf_rows: Rows
    prows: Rows  # rows of the parameter's row axis
    cols: Rows | None  # a column block's [a, b) of dim 1
    row_bytes: int  # one whole HF row
    width: int  # bytes per row this slice holds (row_bytes unless a column block)
    col0: int  # byte offset of the block's first column within a row
    param: str
    ncols: int = 1  # the HF tensor's dim 1 (1 for a 1-D tensor)


class TransferPlan:
    """Every (trainer rank, HF tensor slice) -> (engine group, byte range), from both layouts."""

    def __init__(self, trainer: TrainerLayout, engines: Sequence[EngineLayout]) -> None:
        if not engines:
            raise SyncError("transfer plan: no engine layout")
        self.trainer, self.engines = trainer, tuple(engines)
        sent = {p.hf_name: trainer.dtype_of(prm) for prm in trainer.params for p in prm.parts}
        for g, eng in enumerate(self.engines):
            for name, dt in zip(eng.plan.names, eng.plan.dtypes, strict=True):
                if sent.get(name, dt) != dt:
                    raise SyncError(f"transfer plan: engine group {g} lands {name!r} as {dt}, the trainer sends "
                                    f"{sent[name]}")
        index = [dict(zip(e.plan.names, range(len(e.plan.names)), strict=True)) for e in self.engines]
        raw, hf_seen = self._slices(trainer)
        for g, eng in enumerate(self.engines):
            missing = set(eng.plan.names) - hf_seen
            if missing:
                raise SyncError(f"transfer plan: engine group {g} holds {len(missing)} tensor(s) no trainer "
                                f"parameter has, e.g. {sorted(missing)[:3]}")
        self.send_bytes: list[int] = []
        self.pieces: list[list[Piece]] = []
        self.sends: list[list[SendSlice]] = []
        first = index[0]
        for r in range(trainer.world):
            # Send-buffer order: per rank, its slices in the first group's plan order, so a
            # whole-model engine's bucket is one contiguous run of the send buffer.
            raw[r].sort(key=lambda x: (first.get(x.hf, len(first)), x.hf_rows[0], x.col0))
            pieces, sends, pos = [], [], 0
            for x in raw[r]:
                n = (x.hf_rows[1] - x.hf_rows[0]) * x.width
                sends.append(SendSlice(x.param, x.expert, x.prows, x.cols, pos, n))
                for g, eng in enumerate(self.engines):
                    i = index[g].get(x.hf)
                    if i is None:
                        continue
                    ga, gb = eng.rows.get(x.hf, (0, 1 << 62))  # the rows this group holds
                    lo, hi = max(x.hf_rows[0], ga), min(x.hf_rows[1], gb)
                    if lo >= hi:
                        continue
                    # columns: the slice's [a, b) ∩ the group's [e0, e1) (whole rows: all of them)
                    cb = x.row_bytes // x.ncols
                    a, b = x.cols or (0, x.ncols)
                    e0, e1 = eng.cols.get(x.hf, (0, x.ncols))
                    c0, c1 = max(a, e0), min(b, e1)
                    if c0 >= c1:
                        continue
                    width, erow = (c1 - c0) * cb, (e1 - e0) * cb  # bytes per row: piece, engine slot
                    src = pos + (lo - x.hf_rows[0]) * x.width + (c0 - a) * cb
                    dst = eng.plan.offsets[i] + (lo - ga) * erow + (c0 - e0) * cb
                    block = width != x.width or width != erow  # rows not back to back on one side
                    pieces.append(Piece(r, g, x.hf, (lo, hi), x.param, x.expert,
                                        (x.prows[0] + lo - x.hf_rows[0], x.prows[0] + hi - x.hf_rows[0]),
                                        src, dst, (hi - lo) * width, (c0, c1) if block else None,
                                        erow if block else 0, x.width if block and x.width != width else 0))
                pos += n
            self.pieces.append(pieces)
            self.sends.append(sends)
            self.send_bytes.append(pos)
        self._check_cover()
        h = xxhash.xxh64(repr((trainer, [(e.plan.digest, sorted(e.rows.items()), sorted(e.cols.items()))
                                          for e in self.engines])).encode())
        self.digest = h.hexdigest()

    @staticmethod
    def _slices(trainer: TrainerLayout) -> tuple[list[list[_Slice]], set[str]]:
        """Per rank, every (parameter slice ∩ HF tensor segment) it owns, in HF coordinates."""
        raw: list[list[_Slice]] = [[] for _ in range(trainer.world)]
        hf_seen: set[str] = set()
        for prm in trainer.params:
            item = dtype_of(trainer.dtype_of(prm)).itemsize
            if len(prm.owned) != trainer.world:
                raise SyncError(f"transfer plan: parameter {prm.name!r} lists {len(prm.owned)} rank ranges for "
                                f"{trainer.world} ranks")
            here = {p.hf_name for p in prm.parts}
            twice = here & hf_seen
            if twice:
                raise SyncError(f"transfer plan: HF tensor {sorted(twice)[0]!r} is held by two parameters")
            hf_seen |= here
            for part in prm.parts:
                row_bytes = item
                for s in part.row_shape:
                    row_bytes *= s
                for r, (a, b) in enumerate(prm.owned):
                    if a == b:
                        continue
                    if prm.dim == 1:  # a column block: every row of the part, columns [a, b)
                        col = row_bytes // prm.shape[1]
                        hf_rows = (part.at, part.at + part.rows[1] - part.rows[0])
                        raw[r].append(_Slice(part.hf_name, part.expert, hf_rows, part.rows, (a, b), row_bytes,
                                             (b - a) * col, a * col, prm.name, prm.shape[1]))
                        continue
                    if part.expert is not None:  # dim 0 is the expert axis: whole experts per rank
                        if not a <= part.expert < b:
                            continue
                        lo, hi = part.rows
                    else:
                        lo, hi = max(a, part.rows[0]), min(b, part.rows[1])
                        if lo >= hi:
                            continue
                    off = part.at - part.rows[0]
                    raw[r].append(_Slice(part.hf_name, part.expert, (lo + off, hi + off), (lo, hi), None, row_bytes,
                                         row_bytes, 0, prm.name, part.row_shape[0] if part.row_shape else 1))
        return raw, hf_seen

    def _check_cover(self) -> None:
        """Every byte of every engine group's plan is sent by exactly one rank."""
        for g, eng in enumerate(self.engines):
            starts: list[Any] = []
            widths: list[Any] = []
            for ps in self.pieces:
                for p in ps:
                    if p.group != g:
                        continue
                    if p.stride:
                        starts.append(p.dst + p.stride * np.arange(p.rows[1] - p.rows[0], dtype=np.int64))
                        widths.append(np.full(p.rows[1] - p.rows[0], p.width, dtype=np.int64))
                    else:
                        starts.append(np.array([p.dst], dtype=np.int64))
                        widths.append(np.array([p.nbytes], dtype=np.int64))
            lo = np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)
            order = np.argsort(lo, kind="stable")
            lo = lo[order]
            hi = lo + (np.concatenate(widths)[order] if widths else lo)
            prev = np.concatenate([[0], hi[:-1]])
            bad = np.nonzero(lo != prev)[0]
            if bad.size:
                i = int(bad[0])
                raise SyncError(f"transfer plan: engine group {g} bytes [{min(prev[i], lo[i])}, {max(prev[i], lo[i])}) "
                                "are " + ("sent twice" if lo[i] < prev[i] else "sent by no rank"))
            got = int(hi[-1]) if hi.size else 0
            if got != eng.plan.nbytes:
                raise SyncError(f"transfer plan: engine group {g} receives {got} of {eng.plan.nbytes} bytes")

    def buckets(self, rank: int, group: int, bucket_bytes: int) -> list[ShardBucket]:
        """Rank `rank`'s pieces for engine group `group`, cut into buckets of at most `bucket_bytes`
        (a piece larger than a bucket spans several; byte ranges need no element alignment).
        Runs adjacent on both sides are merged: a whole-model bucket is one source run."""
        if bucket_bytes <= 0:
            raise SyncError(f"bucket size must be positive, got {bucket_bytes} bytes")
        out: list[ShardBucket] = []
        runs: list[list[int]] = []
        marks: list[bool] = []
        size = 0

        def flush() -> None:
            out.append(ShardBucket(tuple((a, b, c) for a, b, c in runs), size, tuple(marks) if any(marks) else ()))

        for p in self.pieces[rank]:
            if p.group != group:
                continue
            for s, d, n in p.runs():
                while n:
                    take = min(n, bucket_bytes - size)
                    if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
                        runs[-1][2] += take
                        marks[-1] = False
                    else:
                        runs.append([s, d, take])
                        marks.append(bool(p.stride))
                    s, d, n, size = s + take, d + take, n - take, size + take
                    if size == bucket_bytes:
                        flush()
                        runs, marks, size = [], [], 0
        if runs:
            flush()
        return out


@dataclass
class ShardExport:
    """What one trainer rank pushes: its send buffer (uint8, the plan's `send_bytes[rank]`) and the plan."""

    buffer: Any  # torch.Tensor (uint8, 1-D); typed loosely so the plan stays torch-free to read
    plan: TransferPlan
    rank: int
