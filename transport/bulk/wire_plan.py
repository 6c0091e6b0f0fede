"""How one bucket's bytes go over a byte-stream channel (broadcast, ucx), and where they land.

Sender: a bucket is cut into segments of consecutive tensors. A large run lying back to
back in the trainer's memory is a segment sent from there (no pack copy); the tensors
between such runs are packed into one segment each. Senders keep one pack buffer per
bucket in flight (`sync.pipeline_depth`), so packing bucket i+1 never touches bytes bucket
i is still sending.

Receiver: every segment lands straight in its place in a buffer laid out like the bucket:
the engine's staging slots when they are (nothing to copy when staging), else the
receiver's bucket buffer. The header names the segments, so a receiver posts the same
sequence of receives.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from miles.core.errors import SyncError
from miles.transport.bulk.base import (
    BulkSender,
    Layout,
    LocalWeights,
    SenderPlace,
    slot_region,
    unpack,
)
from miles.transport.bulk.buckets import Bucket

# A run at least this large is sent from the trainer's memory; below it, one more message
# costs more than the copy into the pack buffer. On a GPU a copy runs at ~2 TB/s while a
# message costs tens of microseconds, so only very large runs go on their own there.
DIRECT_MIN_BYTES = 1 << 20
DIRECT_MIN_BYTES_GPU = 64 << 20


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    # The address test first: it is cheap and rules out almost every non-adjacent pair.
    return (a.data_ptr() + _nbytes(a) == b.data_ptr() and a.dtype == b.dtype and a.device == b.device
            and a.is_contiguous() and b.is_contiguous()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def runs_of(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """[start, end) index runs of contiguous tensors lying back to back in one storage."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(tensors):
        if runs and _adjacent(tensors[i - 1], t):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _run_view(tensors: list[torch.Tensor], run: tuple[int, int]) -> torch.Tensor:
    """The bytes of a run as one uint8 tensor over the trainer's memory."""
    first = tensors[run[0]]
    if run[1] - run[0] == 1:
        return _bytes(first)
    out = torch.empty(0, dtype=torch.uint8, device=first.device)
    size = sum(_nbytes(tensors[i]) for i in range(*run))
    out.set_(first.untyped_storage(), first.storage_offset() * first.element_size(), (size,), (1,))
    return out


class PackBuffers:
    """One pack buffer per bucket in flight, used in rotation (allocated on first need)."""

    def __init__(self, depth: int, bucket_bytes: int, device: torch.device) -> None:
        self.bufs: list[torch.Tensor | None] = [None] * depth
        self.bucket_bytes = bucket_bytes
        self.device = device
        self._n = 0

    def next(self, need: int) -> torch.Tensor:
        k = self._n % len(self.bufs)
        self._n += 1
        buf = self.bufs[k]
        if buf is None or buf.numel() < need or buf.device != self.device:
            buf = self.bufs[k] = torch.empty(max(self.bucket_bytes, need), dtype=torch.uint8, device=self.device)
        return buf


@dataclass
class SendPlan:
    header: dict[str, Any]  # layout + segments: what every receiver needs
    sends: list[torch.Tensor]  # one uint8 buffer per segment, in order
    nbytes: int


def plan_sends(bucket: Bucket, bufs: PackBuffers, direct_min: int | None = None) -> SendPlan:
    """Split a bucket into segments of consecutive tensors: a large run lying back to back in
    the trainer's memory is one segment sent from there; the tensors between such runs are
    packed, back to back, into one segment each. A receiver holding a buffer laid out like
    the bucket receives every segment straight into its place: nothing to scatter."""
    lay = Layout.of(bucket)
    ts = bucket.tensors
    floor = direct_min if direct_min is not None else (
        DIRECT_MIN_BYTES_GPU if bufs.device.type == "cuda" else DIRECT_MIN_BYTES)
    segments: list[list[int]] = []  # [start, end, direct]
    for a, b in runs_of(ts):
        direct = int(sum(_nbytes(ts[i]) for i in range(a, b)) >= floor)
        if not direct and segments and not segments[-1][2]:
            segments[-1][1] = b  # consecutive packed runs form one segment
        else:
            segments.append([a, b, direct])
    packed = sum(_nbytes(ts[i]) for a, b, d in segments if not d for i in range(a, b))
    buf = bufs.next(packed) if packed else None
    sends, pos = [], 0
    for a, b, direct in segments:
        if direct:
            sends.append(_run_view(ts, (a, b)))
            continue
        assert buf is not None
        parts = [_bytes(ts[i]) for i in range(a, b)]
        n = sum(p.numel() for p in parts)
        # One gather for the whole segment: a copy per tensor costs a kernel launch each on a GPU.
        torch.cat(parts, out=buf[pos:pos + n])
        sends.append(buf[pos:pos + n])
        pos += n
    return SendPlan({"layout": lay.to_wire(), "segments": segments}, sends, lay.nbytes)


class SegmentSender(BulkSender):
    """A sender whose buckets travel as segments: planned at `prepare`, sent in that order.

    `device` is where the weights live (the sender's place); pack buffers follow it.
    """

    direct_min: ClassVar[int | None] = None  # smallest run sent unpacked; None: by device

    def __init__(self, cfg: Any, place: SenderPlace | None = None) -> None:
        super().__init__(cfg, place)
        self._packs = PackBuffers(cfg.pipeline_depth, self.bucket_bytes, self.device)
        self._ready: deque[SendPlan] = deque()  # prepared buckets, in transmit order

    def prepare(self, version: int, seq: int, bucket: Bucket) -> dict[str, Any]:
        self._packs.device = self.device  # a buffer on another device is reallocated on use
        plan = plan_sends(bucket, self._packs, self.direct_min)
        self._ready.append(plan)
        return plan.header

    flat = True  # a flat export's range is one segment, sent from the trainer's buffer

    def prepare_flat(self, version: int, seq: int, lo: int, hi: int, weights: Any) -> dict[str, Any]:
        header = {"lo": lo, "hi": hi}
        self._ready.append(SendPlan(header, [weights.buffer[lo:hi]], hi - lo))
        return header

    def next_plan(self) -> SendPlan:
        """The oldest prepared bucket (transmits run in prepare order)."""
        if not self._ready:
            raise SyncError(f"{self.tag}: transmit before prepare")
        return self._ready.popleft()


def flat_target(tag: str, header: dict[str, Any], landing: Any, local: LocalWeights,
                buf: torch.Tensor) -> tuple[int, int, torch.Tensor, bool, torch.Tensor]:
    """Where one flat range (weightsync/flat.py) is received: (lo, hi, destination, whether
    that is the engine's staging slots themselves, the receiver's bucket buffer). Not in
    place: after the receive, `landing.land(lo, hi, destination, local)` copies it there."""
    try:
        lo, hi = int(header["lo"]), int(header["hi"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SyncError(f"{tag} flat range header is malformed: {exc}") from exc
    if not 0 <= lo < hi <= landing.plan.nbytes:
        raise SyncError(f"{tag} flat range [{lo}, {hi}) lies outside the plan's {landing.plan.nbytes} bytes")
    region = landing.region(local)
    if region is not None and region.device == buf.device:
        return lo, hi, region[lo:hi], True, buf
    if hi - lo > buf.numel():
        buf = torch.empty(hi - lo, dtype=torch.uint8, device=buf.device)
    return lo, hi, buf[:hi - lo], False, buf


def flat_landed(landing: Any, lo: int, hi: int, dst: torch.Tensor, in_place: bool, local: LocalWeights) -> list[str]:
    """After a flat range's receive: the names it completes (copied into the slots if needed)."""
    names: list[str] = landing.plan.done_in(lo, hi) if in_place else landing.land(lo, hi, dst, local)
    return names


class Landing:
    """Receiver side of one bucket: the buffers to receive into, then the tensors they make."""

    def __init__(self, tag: str, header: dict[str, Any], local: LocalWeights, buf: torch.Tensor) -> None:
        self.lay = lay = Layout.from_wire(header.get("layout", {}))
        try:
            segments = [(int(a), int(b)) for a, b, _ in header["segments"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise SyncError(f"{tag} bucket header is malformed: {exc}") from exc
        if [i for a, b in segments for i in range(a, b)] != list(range(len(lay.names))):
            raise SyncError(f"{tag} bucket header: segments {segments} do not cover its "
                            f"{len(lay.names)} tensors in order")
        region = slot_region(lay, local, buf.device)
        self.into_slots = region is not None
        if region is None:
            if lay.nbytes > buf.numel():
                buf = torch.empty(lay.nbytes, dtype=torch.uint8, device=buf.device)
            region = buf[: lay.nbytes]
        self.buf, self.local = buf, local
        ends = [*lay.offsets[1:], lay.nbytes]
        self.recvs = [region[lay.offsets[a]:ends[b - 1]] for a, b in segments]

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """After every receive completed: the engine's own slots, or views of the bucket
        buffer (valid until its reuse)."""
        if self.into_slots and self.local.slot is not None:
            return [(n, self.local.slot(n)) for n in self.lay.names]
        return unpack(self.lay, self.buf)
