"""Flat weight exports: weights lying back to back in one buffer, moved as byte ranges.

A trainer that keeps its weights in one buffer in HF order (a contiguous parameter
buffer) exports them as `FlatWeights`: the buffer plus a `FlatPlan` naming every
tensor's dtype, shape and byte offset. The plan is fixed across versions, so it goes
to each engine once (`BulkPlan`), is checked there once against the engine's staging
slots, and every later version moves only byte ranges: a bucket is `[lo, hi)` of the
buffer, with no per-tensor work on either side. That per-tensor work (views, layouts,
staging bookkeeping) is what dominates a fast link: an 8 GB model is ~900 tensors.

Buckets keep the fixed-size contract: a range is cut at tensor boundaries, and a tensor
larger than a bucket spans several ranges (its slot is filled piece by piece, no
reassembly copy). `FlatWeights` also iterates as (name, view) pairs, so a channel without
the flat path sends it like any other export.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from miles.core.errors import MilesError, SyncError
from miles.transport.bulk.base import LocalWeights, dtype_of


class FlatDeclined(SyncError):
    """The plan fits the engine's tensors but cannot land as bytes (another dtype, a strided
    slot): the engine declines it and the coordinator sends tensors, which convert."""


# An engine's reason for declining every flat plan: it has no staging slots (an SGLang engine
# hands whole versions to its server). The coordinator tells this apart from a slot mismatch,
# which `sync.dtype` can fix.
NO_SLOTS = "has no staging slots to land byte ranges in"


@dataclass(frozen=True)
class FlatPlan:
    """Where each HF tensor lies in a flat buffer (byte offsets from the buffer's start)."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    nbytes: int
    digest: str = field(default="", compare=False)
    ends: tuple[int, ...] = field(default=(), init=False, compare=False, repr=False)  # byte end of each tensor

    def __post_init__(self) -> None:
        n = len(self.names)
        if not n == len(self.dtypes) == len(self.shapes) == len(self.offsets):
            raise SyncError(f"flat plan lists differ in length: {n} names, {len(self.dtypes)} dtypes, "
                            f"{len(self.shapes)} shapes, {len(self.offsets)} offsets")
        if len(set(self.names)) != n:
            raise SyncError("flat plan names a tensor twice")
        ends = []
        for dt, shape, off in zip(self.dtypes, self.shapes, self.offsets, strict=True):
            size = dtype_of(dt).itemsize
            for s in shape:
                size *= s
            ends.append(off + size)
        object.__setattr__(self, "ends", tuple(ends))
        for i in range(n):
            nxt = self.offsets[i + 1] if i + 1 < n else self.nbytes
            if self.offsets[i] < 0 or ends[i] != nxt:
                raise SyncError(f"flat plan: tensor {self.names[i]!r} at bytes [{self.offsets[i]}, {ends[i]}) does "
                                f"not end where the next one starts ({nxt}); tensors must lie back to back")
        if not self.digest:
            h = xxhash.xxh64()
            for part in (self.names, self.dtypes, self.shapes, self.offsets, (self.nbytes,)):
                h.update(repr(part).encode())
            object.__setattr__(self, "digest", h.hexdigest())

    def ranges(self, bucket_bytes: int) -> list[tuple[int, int]]:
        """Bucket byte ranges: at most `bucket_bytes` each, cut at tensor boundaries; a tensor
        larger than a bucket is cut into bucket-sized pieces of its own."""
        if bucket_bytes <= 0:
            raise SyncError(f"bucket size must be positive, got {bucket_bytes} bytes")
        out: list[tuple[int, int]] = []
        lo = 0
        for off, end in zip(self.offsets, self.ends, strict=True):
            if end - lo <= bucket_bytes:
                continue  # still fits in the bucket being filled
            if off > lo:
                out.append((lo, off))
                lo = off
            while end - lo > bucket_bytes:
                out.append((lo, lo + bucket_bytes))
                lo += bucket_bytes
        if lo < self.nbytes:
            out.append((lo, self.nbytes))
        return out

    def done_in(self, lo: int, hi: int) -> list[str]:
        """Names of the tensors whose last byte lies in [lo, hi): complete once that range landed
        (ranges land in order)."""
        return list(self.names[bisect.bisect_right(self.ends, lo):bisect.bisect_right(self.ends, hi)])

    def to_wire(self) -> dict[str, Any]:
        return {"names": list(self.names), "dtypes": list(self.dtypes), "shapes": [list(s) for s in self.shapes],
                "offsets": list(self.offsets), "nbytes": self.nbytes, "digest": self.digest}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> FlatPlan:
        try:
            plan = cls(tuple(str(n) for n in d["names"]), tuple(str(t) for t in d["dtypes"]),
                       tuple(tuple(int(x) for x in s) for s in d["shapes"]), tuple(int(o) for o in d["offsets"]),
                       int(d["nbytes"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise SyncError(f"malformed flat plan: {type(exc).__name__}: {exc}") from exc
        if d.get("digest") not in (None, plan.digest):
            raise SyncError(f"flat plan digest {d.get('digest')!r} does not match its contents ({plan.digest})")
        return plan


class FlatWeights:
    """A flat weight buffer (uint8 view, from the plan's byte 0) and its plan.

    The trainer builds it once and keeps it: the buffer's bytes change with every optimizer
    step, the plan does not. Iterating yields (name, view) pairs, built per call.
    """

    def __init__(self, buffer: torch.Tensor, plan: FlatPlan) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise SyncError("FlatWeights: the buffer must be a contiguous 1-D uint8 view")
        if buffer.numel() != plan.nbytes:
            raise SyncError(f"FlatWeights: buffer holds {buffer.numel()} bytes, plan needs {plan.nbytes}")
        self.buffer, self.plan = buffer, plan

    @classmethod
    def of(cls, named: Iterable[tuple[str, torch.Tensor]]) -> FlatWeights:
        """The flat export of tensors that lie back to back in one storage, in this order;
        SyncError names the first tensor that does not."""
        items = list(named)
        if not items:
            raise SyncError("FlatWeights.of: no tensors")
        first = items[0][1]
        st = first.untyped_storage()
        base = first.data_ptr()
        names, dtypes, shapes, offsets, pos = [], [], [], [], 0
        for name, t in items:
            if (not t.is_contiguous() or t.device != first.device or t.data_ptr() != base + pos
                    or t.untyped_storage().data_ptr() != st.data_ptr()):
                raise SyncError(f"FlatWeights.of: tensor {name!r} does not follow the previous one in the same "
                                "buffer; the flat export needs every tensor back to back in one storage, in order")
            names.append(name)
            dtypes.append(str(t.dtype).removeprefix("torch."))
            shapes.append(tuple(t.shape))
            offsets.append(pos)
            pos += t.numel() * t.element_size()
        buf = torch.empty(0, dtype=torch.uint8, device=first.device)
        buf.set_(st, first.storage_offset() * first.element_size(), (pos,), (1,))
        return cls(buf, FlatPlan(tuple(names), tuple(dtypes), tuple(shapes), tuple(offsets), pos))

    @classmethod
    @torch.no_grad()
    def copy_of(cls, named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> FlatWeights:
        """A new buffer holding copies of the tensors back to back, in order, in `dtype`
        (default: the first tensor's), on the first tensor's device."""
        items = list(named)
        if not items:
            raise SyncError("FlatWeights.copy_of: no tensors")
        first = items[0][1]
        buf = torch.empty(sum(t.numel() for _, t in items), dtype=dtype or first.dtype, device=first.device)
        views, pos = [], 0
        for name, t in items:
            v = buf[pos:pos + t.numel()].view(t.shape)
            v.copy_(t)
            views.append((name, v))
            pos += t.numel()
        return cls.of(views)

    @classmethod
    @torch.no_grad()
    def pack(cls, named: Iterable[tuple[str, torch.Tensor]], device: torch.device | None = None,
             reuse: FlatWeights | None = None, dtype: torch.dtype | None = None) -> FlatWeights:
        """The tensors' bytes copied back to back into one buffer on `device` (None: the first
        tensor's, as it names it: no thread's current CUDA device is assumed), each keeping its
        dtype or cast to `dtype` (one copy: a tensor-by-tensor export as a flat one). Widest
        elements first, so that every tensor starts aligned to its element size with no padding
        (the plan has none); same width, in the given order. `reuse`: the last call's result,
        refilled in place when the tensors are the same (names, dtypes, shapes); else a new buffer."""
        it: Iterator[tuple[str, torch.Tensor]] = iter(named)
        if dtype is not None:
            it = ((n, t.to(dtype)) for n, t in it)
        if reuse is not None:
            p = reuse.plan
            at = {n: i for i, n in enumerate(p.names)}
            done: list[str] = []
            for name, t in it:
                i = at.get(name)
                if i is None or str(t.dtype).removeprefix("torch.") != p.dtypes[i] or tuple(t.shape) != p.shapes[i]:
                    # another export than last time: repack what was copied and the rest afresh
                    views = dict(reuse)
                    return cls.pack([*((n, views[n]) for n in done), (name, t), *it], device)
                reuse.buffer[p.offsets[i]:p.ends[i]].view(t.dtype).view(t.shape).copy_(t)
                done.append(name)
            if len(done) == len(p.names) and len(set(done)) == len(done):
                return reuse
            views = dict(reuse)
            return cls.pack([(n, views[n]) for n in done], device)  # fewer tensors (or one twice): a new plan
        items = sorted(it, key=lambda nt: -nt[1].element_size())  # stable: the given order within a width
        names, dtypes, shapes, offsets, pos = [], [], [], [], 0
        for name, t in items:
            names.append(name)
            dtypes.append(str(t.dtype).removeprefix("torch."))
            shapes.append(tuple(t.shape))
            offsets.append(pos)
            pos += t.numel() * t.element_size()
        plan = FlatPlan(tuple(names), tuple(dtypes), tuple(shapes), tuple(offsets), pos)
        if device is None:
            device = items[0][1].device if items else torch.device("cpu")
        out = cls(torch.empty(pos, dtype=torch.uint8, device=device), plan)
        for (_, t), (_, v) in zip(items, out, strict=True):
            v.copy_(t)
        return out

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        p = self.plan
        for name, dt, shape, off, end in zip(p.names, p.dtypes, p.shapes, p.offsets, p.ends, strict=True):
            yield name, self.buffer[off:end].view(dtype_of(dt)).view(shape)


class FlatLanding:
    """Engine side: where each byte range of a plan lands in the engine's staging slots.

    Checked once per staging buffer (engines keep two that swap at commit): when the slots
    are laid out exactly like the plan, a range is one copy into them; otherwise each range
    is copied piecewise into the slots it overlaps.
    """

    def __init__(self, plan: FlatPlan) -> None:
        self.plan = plan
        # Staging buffer (its storage address and size, the first slot's address) -> the region
        # laid out like the plan, or None and per-tensor byte views instead.
        self._regions: dict[tuple[int, int, int], torch.Tensor | None] = {}
        self._pieces: dict[tuple[int, int, int], list[torch.Tensor]] = {}

    def _slots(self, local: LocalWeights) -> list[torch.Tensor]:
        assert local.slot is not None
        p = self.plan
        try:
            slots = [local.slot(n) for n in p.names]
        except MilesError as exc:
            raise SyncError(f"flat plan does not match this engine: {exc}") from exc
        for s, name, dt, shape in zip(slots, p.names, p.dtypes, p.shapes, strict=True):
            if tuple(s.shape) != shape:
                raise SyncError(f"flat plan: tensor {name!r} has shape {list(shape)}, this engine holds "
                                f"{list(s.shape)}")
            held = str(s.dtype).removeprefix("torch.")
            if dt == "uint8" and s.dtype.is_floating_point and s.element_size() == 1:
                held = dt  # FP8 codes travel as their raw bytes (models/fp8_model.py `fp8_export`): the same bytes
            if held != dt or not s.is_contiguous():
                raise FlatDeclined(f"tensor {name!r} travels as {dt}, this engine holds {held}" if held != dt
                                   else f"this engine's slot of {name!r} is not contiguous")
        return slots

    def region(self, local: LocalWeights) -> torch.Tensor | None:
        """The staging bytes laid out like the plan, or None (piecewise landing)."""
        return self._regions[self._check(local)]

    def _check(self, local: LocalWeights) -> tuple[int, int, int]:
        """Key of the engine's current staging buffer, its slots checked against the plan once."""
        if local.slot is None:
            raise SyncError("flat plan: this engine offers no staging slots")
        try:
            first = local.slot(self.plan.names[0])
        except MilesError as exc:
            raise SyncError(f"flat plan does not match this engine: {exc}") from exc
        st0 = first.untyped_storage()
        key = (st0.data_ptr(), st0.nbytes(), first.data_ptr())
        if key not in self._regions:
            slots = self._slots(local)
            base, st = slots[0].data_ptr(), slots[0].untyped_storage()
            flat = all(s.data_ptr() == base + off and s.untyped_storage().data_ptr() == st.data_ptr()
                       for s, off in zip(slots, self.plan.offsets, strict=True))
            region = None
            if flat:
                region = torch.empty(0, dtype=torch.uint8, device=slots[0].device)
                region.set_(st, slots[0].storage_offset() * slots[0].element_size(), (self.plan.nbytes,), (1,))
            else:
                self._pieces[key] = [s.view(-1).view(torch.uint8) for s in slots]
            self._regions[key] = region
        return key

    def land(self, lo: int, hi: int, src: torch.Tensor, local: LocalWeights) -> list[str]:
        """Copy `src` (the plan's bytes [lo, hi), uint8) into the staging slots (asynchronously
        on a GPU); returns the names this range completes."""
        if not 0 <= lo < hi <= self.plan.nbytes or src.numel() != hi - lo:
            raise SyncError(f"flat range [{lo}, {hi}) with {src.numel()} bytes does not fit the plan's "
                            f"{self.plan.nbytes} bytes")
        key = self._check(local)
        region = self._regions[key]
        if region is not None:
            region[lo:hi].copy_(src, non_blocking=True)
        else:  # slots not laid out like the plan: per tensor, the slow path
            pieces, p = self._pieces[key], self.plan
            for i in range(bisect.bisect_right(p.ends, lo), len(p.names)):
                off, end = p.offsets[i], p.ends[i]
                if off >= hi:
                    break
                a, b = max(off, lo), min(end, hi)
                pieces[i][a - off:b - off].copy_(src[a - lo:b - lo], non_blocking=True)
        return self.plan.done_in(lo, hi)
