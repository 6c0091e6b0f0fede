"""How one bucket's bytes go over a byte-stream channel (broadcast, ucx), and where they land.

Sender: runs of tensors that lie back to back in the trainer's memory and are large
enough go straight from there (no pack copy); the small rest is packed into one buffer.
Senders keep one pack buffer per bucket in flight (`sync.pipeline_depth`), so packing
bucket i+1 never touches bytes bucket i is still sending.

Receiver: the bucket lands straight in the engine's staging slots when they are laid out
like the bucket (nothing to copy when staging), else in the receiver's bucket buffer.
The header names the runs, so a receiver posts the same sequence of receives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from miles.core.errors import SyncError
from miles.transport.bulk.base import Layout, LocalWeights, slot_region, unpack
from miles.transport.bulk.buckets import Bucket

# A run at least this large is sent from the trainer's memory; below it, one more message
# costs more than the copy into the pack buffer.
DIRECT_MIN_BYTES = 1 << 20


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.is_contiguous() and b.is_contiguous() and a.dtype == b.dtype and a.device == b.device
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.data_ptr() + _nbytes(a) == b.data_ptr())


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
    out.set_(first.untyped_storage(), first.storage_offset() * first.element_size(), (size,))
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
    header: dict[str, Any]  # layout + runs: what every receiver needs
    sends: list[torch.Tensor]  # uint8 buffers, in the order receivers post their receives
    nbytes: int


def plan_sends(bucket: Bucket, bufs: PackBuffers) -> SendPlan:
    lay = Layout.of(bucket)
    ts = bucket.tensors
    direct = [r for r in runs_of(ts) if sum(_nbytes(ts[i]) for i in range(*r)) >= DIRECT_MIN_BYTES]
    packed = [i for i in range(len(ts)) if not any(a <= i < b for a, b in direct)]
    sends = [_run_view(ts, r) for r in direct]
    if packed:
        buf = bufs.next(sum(_nbytes(ts[i]) for i in packed))
        pos = 0
        for i in packed:
            b = _bytes(ts[i])
            buf[pos:pos + b.numel()].copy_(b)
            pos += b.numel()
        sends.append(buf[:pos])
    return SendPlan({"layout": lay.to_wire(), "direct": [list(r) for r in direct], "packed": packed},
                    sends, lay.nbytes)


class Landing:
    """Receiver side of one bucket: the buffers to receive into, then the tensors they make."""

    def __init__(self, tag: str, header: dict[str, Any], local: LocalWeights, buf: torch.Tensor) -> None:
        self.lay = lay = Layout.from_wire(header.get("layout", {}))
        try:
            direct = [(int(a), int(b)) for a, b in header["direct"]]
            self.packed = [int(i) for i in header["packed"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise SyncError(f"{tag} bucket header is malformed: {exc}") from exc
        covered = sorted([i for a, b in direct for i in range(a, b)] + self.packed)
        if covered != list(range(len(lay.names))):
            raise SyncError(f"{tag} bucket header: direct runs {direct} and packed {self.packed} "
                            f"do not cover its {len(lay.names)} tensors once each")
        region = slot_region(lay, local, buf.device)
        self.into_slots = region is not None
        if region is None:
            if lay.nbytes > buf.numel():
                buf = torch.empty(lay.nbytes, dtype=torch.uint8, device=buf.device)
            region = buf[: lay.nbytes]
        self.buf, self.region, self.local = buf, region, local
        self.ends = [*lay.offsets[1:], lay.nbytes]
        self.recvs = [region[lay.offsets[a]:self.ends[b - 1]] for a, b in direct]
        small = sum(self.ends[i] - lay.offsets[i] for i in self.packed)
        self._tmp = torch.empty(small, dtype=torch.uint8, device=region.device) if self.packed else None
        if self._tmp is not None:
            self.recvs.append(self._tmp)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """After every receive completed: scatter the packed part, return what was received
        (the engine's own slots, or views of the bucket buffer valid until its reuse)."""
        if self._tmp is not None:
            pos = 0
            for i in self.packed:
                n = self.ends[i] - self.lay.offsets[i]
                self.region[self.lay.offsets[i]:self.ends[i]].copy_(self._tmp[pos:pos + n])
                pos += n
        if self.into_slots and self.local.slot is not None:
            return [(n, self.local.slot(n)) for n in self.lay.names]
        return unpack(self.lay, self.buf)
