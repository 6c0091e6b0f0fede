"""The bulk-channel interface weight bytes travel on, and the registry of channels by tag.

One sender class per channel (`BulkSender`, registered by `sync.transport`) and one receiver
per engine (`BulkReceiver`); both coordinators drive the same senders:

- the gathered coordinator (weightsync/coordinator.py: one process holds the model) moves
  buckets of tensors or flat byte ranges: per bucket `prepare()` gives the layout header
  forwarded to every receiver, then `transmit()` runs concurrently with every receiver's
  `recv()` (streaming channels) or before them (`streaming = False`: the receivers read after
  `finish()`, e.g. a directory written atomically);
- the sharded coordinator (weightsync/shard_coordinator.py: every trainer rank sends its own
  bytes, a gathered flat export as one rank) moves each rank's buckets of a transfer plan:
  `header()` per bucket, then `send()` to each engine (channels with `sharded = True`).

Control (what comes next, its layout) travels as small msgpack messages over the actor wire;
the bytes travel on the channel.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from miles.core.errors import MilesError, SyncError
from miles.core.hooks import Registry
from miles.core.schema.sync import SyncConfig
from miles.transport.bulk.buckets import Bucket

# Tags of `sync.transport` -> sender / receiver classes, imported only when chosen.
SENDERS = Registry("sync.transport", {
    "zmq": "miles.transport.bulk.zmq_channel:ZmqSender",
    "broadcast": "miles.transport.bulk.broadcast:BroadcastSender",
    "disk_delta": "miles.transport.bulk.disk_delta:DiskDeltaSender",
    "ucx": "miles.transport.bulk.ucx:UcxSender",
    "cuda_ipc": "miles.transport.bulk.cuda_ipc:CudaIpcSender",
})
RECEIVERS = Registry("sync.transport", {
    "broadcast": "miles.transport.bulk.broadcast:BroadcastReceiver",
    "disk_delta": "miles.transport.bulk.disk_delta:DiskDeltaReceiver",
    "ucx": "miles.transport.bulk.ucx:UcxReceiver",
    "cuda_ipc": "miles.transport.bulk.cuda_ipc:CudaIpcReceiver",
    # Sharded syncs (every trainer rank sends its own bytes): one receiver takes every rank's.
    "sharded": "miles.transport.bulk.shard_receiver:ShardReceiver",
})



@dataclass
class LocalWeights:
    """What a receiving engine holds now: its live version and its tensors by HF name.

    `slot`, when the engine offers it, gives the staging destination of an HF tensor: a
    receiver may write a bucket straight into it and return the slots themselves (the
    engine then stages them without another copy).
    """

    version: int
    get: Callable[[str], torch.Tensor]
    slot: Callable[[str], torch.Tensor] | None = None


# Verified bucket layouts -> staging storage offset. An engine's slots live in two persistent
# buffers (live and staged swap), so each bucket layout verifies once per buffer, not per
# version: the per-tensor checks are the costly part of a bucket on a fast link.
_VERIFIED: OrderedDict[tuple[Any, ...], int] = OrderedDict()
_VERIFIED_MAX = 4096


def slot_region(lay: Layout, local: LocalWeights, device: torch.device) -> torch.Tensor | None:
    """A uint8 view of staging memory laid out exactly as bucket `lay` (so the bucket can be
    written there in one go), or None when the engine's slots are not arranged that way."""
    if local.slot is None or not lay.names:
        return None
    try:
        first, last = local.slot(lay.names[0]), local.slot(lay.names[-1])
    except MilesError:
        return None  # e.g. a chunk of a larger tensor: not a slot of its own
    if first.device != device:
        return None
    st = first.untyped_storage()
    key = (tuple(lay.names), tuple(lay.dtypes), lay.nbytes, st.data_ptr(), st.nbytes(), first.data_ptr(),
           last.data_ptr())
    offset = _VERIFIED.get(key)
    if offset is None:
        if not _laid_out(lay, local, first):
            return None
        offset = int(first.storage_offset() * first.element_size())
        _VERIFIED[key] = offset
        if len(_VERIFIED) > _VERIFIED_MAX:
            _VERIFIED.popitem(last=False)
    region = torch.empty(0, dtype=torch.uint8, device=device)
    region.set_(st, offset, (lay.nbytes,), (1,))
    return region


def _laid_out(lay: Layout, local: LocalWeights, first: torch.Tensor) -> bool:
    assert local.slot is not None
    try:
        slots = [local.slot(n) for n in lay.names]
    except MilesError:
        return False
    base = first.data_ptr()
    for s, dt, shape, off in zip(slots, lay.dtypes, lay.shapes, lay.offsets, strict=True):
        if (str(s.dtype).removeprefix("torch.") != dt or list(s.shape) != shape or not s.is_contiguous()
                or s.data_ptr() != base + off or s.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return False
    return True


@dataclass
class Layout:
    """Where each tensor of a bucket lies in its flat byte buffer (msgpack-able via `to_wire`)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    nbytes: int

    @classmethod
    def of(cls, bucket: Bucket) -> Layout:
        offs, pos = [], 0
        for t in bucket.tensors:
            offs.append(pos)
            pos += t.numel() * t.element_size()
        return cls(list(bucket.names), [str(t.dtype).removeprefix("torch.") for t in bucket.tensors],
                   [list(t.shape) for t in bucket.tensors], offs, pos)

    def to_wire(self) -> dict[str, Any]:
        return {"names": self.names, "dtypes": self.dtypes, "shapes": self.shapes,
                "offsets": self.offsets, "nbytes": self.nbytes}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Layout:
        try:
            lay = cls(list(d["names"]), list(d["dtypes"]), [list(s) for s in d["shapes"]],
                      [int(o) for o in d["offsets"]], int(d["nbytes"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise SyncError(f"malformed bucket layout: {exc}") from exc
        if not len(lay.names) == len(lay.dtypes) == len(lay.shapes) == len(lay.offsets):
            raise SyncError(f"bucket layout lists differ in length: {len(lay.names)} names, "
                            f"{len(lay.dtypes)} dtypes, {len(lay.shapes)} shapes, {len(lay.offsets)} offsets")
        return lay


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise SyncError(f"unknown tensor dtype {name!r} in a bucket layout")
    return dt


def unpack(lay: Layout, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of each tensor inside `buf` (valid until the buffer is reused)."""
    if lay.nbytes > buf.numel():
        raise SyncError(f"layout needs {lay.nbytes} bytes, buffer holds {buf.numel()}")
    out = []
    for name, dt_s, shape, off in zip(lay.names, lay.dtypes, lay.shapes, lay.offsets, strict=True):
        dt = dtype_of(dt_s)
        n = dt.itemsize
        for s in shape:
            n *= s
        out.append((name, buf[off:off + n].view(dt).reshape(shape)))
    return out


@dataclass(frozen=True)
class SenderPlace:
    """Where a sender runs: its trainer rank among `world` ranks (a gathered sync is rank 0 of 1),
    the address engines reach it at, and the device its weights live on."""

    rank: int = 0
    world: int = 1
    advertise: str = "127.0.0.1"
    device: torch.device = torch.device("cpu")


class BulkSender(abc.ABC):
    """One trainer rank's side of a channel to every engine. One instance per run; `open` again
    when the peer set changes. The bucket path serves the gathered coordinator, the
    `header`/`send` path the sharded one (`sharded = True`)."""

    tag: ClassVar[str]
    streaming: ClassVar[bool] = True
    inline: ClassVar[bool] = False  # True: the tensors ride in the control message (zmq)
    flat: ClassVar[bool] = False  # True: moves a flat export as byte ranges (`prepare_flat`)
    # Flat ranges in flight at once; 0 = `sync.pipeline_depth`. A channel whose headers hold no
    # buffer of the sender's (cuda_ipc: the engine reads the trainer's memory) sends them all at once.
    flat_window: ClassVar[int] = 0
    sharded: ClassVar[bool] = False  # True: sends a sharded sync's buckets (`header` / `send`)

    def __init__(self, cfg: SyncConfig, place: SenderPlace | None = None) -> None:
        place = place if place is not None else SenderPlace()
        self.cfg = cfg
        self.bucket_bytes = cfg.bucket_mib << 20
        self.timeout_s = cfg.step_timeout_s
        self.rank, self.world, self.advertise, self.device = place.rank, place.world, place.advertise, place.device
        self.peers: list[str] = []

    async def setup(self, peers: list[str]) -> dict[str, Any]:
        """Sharded syncs, rank 0 only, before every rank's `open`: what every rank needs to open
        (e.g. a rendezvous address)."""
        return {}

    @abc.abstractmethod
    async def open(self, peers: list[str], shared: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Set this rank's side up for `peers`; returns what each peer's receiver needs of this rank.
        `shared`: rank 0's `setup` (a sharded sync); None: this sender sets itself up."""

    async def connected(self) -> None:  # noqa: B027 - optional hook
        """Wait until every peer is connected (runs while the engines open their receivers)."""

    # ------------------------------------------------------------------ the gathered coordinator's buckets
    def prepare(self, version: int, seq: int, bucket: Bucket) -> dict[str, Any]:
        """Stage bucket `seq` of `version` for sending; returns the header every receiver gets."""
        raise SyncError(f"the {self.tag} channel has no bucket path")

    def prepare_flat(self, version: int, seq: int, lo: int, hi: int, weights: Any) -> dict[str, Any]:
        """Stage bytes [lo, hi) of a flat export (weightsync/flat.py) for sending; returns
        the header every receiver's `recv_flat` gets. Only channels with `flat = True`."""
        raise SyncError(f"the {self.tag} channel has no flat path")

    async def transmit(self) -> None:
        """Move the prepared bucket's bytes (concurrently with the receivers' `recv`)."""
        raise SyncError(f"the {self.tag} channel has no bucket path")

    async def finish(self, version: int) -> None:  # noqa: B027 - optional hook
        """Called once every bucket of `version` was transmitted."""

    async def committed(self, version: int) -> None:  # noqa: B027 - optional hook
        """Called once `version` is live on the engines (delta channels move their base here)."""

    async def abort(self, version: int) -> None:  # noqa: B027 - optional hook
        """Called when `version` is abandoned; drop anything half-written."""

    # ------------------------------------------------------------------ the sharded coordinator's buckets
    def header(self, seq: int, data: torch.Tensor) -> dict[str, Any]:
        """Channel part of sharded bucket `seq`'s header (the coordinator adds the ranges)."""
        return {"src": self.rank, "seq": seq, "nbytes": int(data.numel())}

    async def send(self, peer: int, seq: int, data: torch.Tensor) -> None:
        """Move sharded bucket `seq`'s bytes to peer #`peer` (runs with that peer's receive)."""
        raise SyncError(f"the {self.tag} channel has no sharded sender (zmq, ucx and broadcast have)")

    @property
    def fanout(self) -> bool:
        """Whether one `send_all` per bucket reaches every peer at once (a collective), in place of
        a `send` per peer."""
        return False

    async def send_all(self, seq: int, data: torch.Tensor) -> None:
        """Move sharded bucket `seq`'s bytes to every peer in one transfer (`fanout` channels)."""
        raise SyncError(f"the {self.tag} channel has no one-transfer send to every engine")

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the channel."""


class BulkReceiver(abc.ABC):
    """Engine side of a channel: receives each bucket into a pre-allocated staging buffer."""

    tag: ClassVar[str]

    def __init__(self, info: dict[str, Any], bucket_bytes: int) -> None:
        self.info = info
        self.bucket_bytes = bucket_bytes

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Connect using `info` (runs once per sender `open`)."""

    @abc.abstractmethod
    async def recv(self, header: dict[str, Any], local: LocalWeights) -> list[tuple[str, torch.Tensor]]:
        """Receive one bucket; returned tensors may be views valid until the next `recv`."""

    async def recv_flat(self, header: dict[str, Any], landing: Any, local: LocalWeights) -> list[str]:
        """Land one flat byte range through `landing` (a FlatLanding); returns the names it completes."""
        raise SyncError(f"the {self.tag} channel has no flat path")

    async def settle(self) -> None:  # noqa: B027 - optional hook
        """The version is about to commit: finish any asynchronous receive work (the sender may
        reuse its memory once the commit is answered)."""

    def release(self) -> None:  # noqa: B027 - optional hook
        """The version being received ended (committed or aborted): drop what it held."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the channel."""


def make_sender(cfg: SyncConfig, place: SenderPlace | None = None, sharded: bool = False) -> BulkSender:
    """The sender of `sync.transport` at `place`; `sharded`: one that sends a sharded sync's buckets."""
    cls = SENDERS.get(cfg.transport)
    if sharded and not cls.sharded:
        raise SyncError(f"sync.transport={cfg.transport!r} has no sharded sender (zmq, ucx and broadcast have)")
    sender: BulkSender = cls(cfg, place)
    return sender


def make_receiver(tag: str, info: dict[str, Any], bucket_bytes: int) -> BulkReceiver:
    cls = RECEIVERS.get(tag)
    return cls(info, bucket_bytes)
