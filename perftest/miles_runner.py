"""The miles side of `miles perftest`: the actor wire and the bulk channels, as miles runs them.

Rank 1 runs a `PerfSink` actor on a miles `Host`; rank 0's host runs the directory
and drives it. Per transport:
  zmq-ctl   `ask`/`tell` of a record whose payload rides inside the msgpack header
  zmq-bulk  `ask`/`tell` of a record carrying tensors as zero-copy frames (the inline
            `zmq` weight channel)
  broadcast, ucx, cuda-ipc, disk
            the weight-sync channels of `transport/bulk/`: per message the sender's
            `prepare` (pack into its staging buffer), the header over the actor wire,
            `transmit` concurrently with the receiver's `recv`, exactly as `WeightSync`
            drives them. disk is non-streaming: a block of messages forms one version,
            written atomically, and the receiver reads after `finish`.
Acks are `ask` replies; in the bucket pattern the ack is the commit of the buckets
staged since the last one (the receiver copies every tensor out of the channel).
"""

from __future__ import annotations

import asyncio
import math
import shutil
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from miles.actors.runtime.actor import Actor, handler
from miles.actors.runtime.directory import Directory
from miles.actors.runtime.host import DIRECTORY_NAME, Host
from miles.core.errors import SyncError, TransportError
from miles.core.schema.sync import SyncConfig
from miles.core.schema.transport import TransportConfig
from miles.transport.bulk.base import Layout, LocalWeights, dtype_of, make_receiver, make_sender
from miles.transport.bulk.buckets import Bucket
from miles.transport.bulk.disk_delta import version_dir
from miles.transport.codec import MAX_HEADER_BYTES
from miles.transport.perf.raw import Ctx, payload, sync
from miles.transport.schema import message

SINK = "perftest-sink"
CHANNEL_TAGS: dict[str, Literal["broadcast", "ucx", "cuda_ipc", "disk_delta"]] = {
    "broadcast": "broadcast", "ucx": "ucx", "cuda-ipc": "cuda_ipc", "disk": "disk_delta"}
ZMQ_CTL_LIMIT = MAX_HEADER_BYTES - 4096  # the payload rides inside the msgpack header
STAGE_TENSORS = 8


@message("perftest.Ctl")
@dataclass
class PerfCtl:
    payload: bytes


@message("perftest.Bulk")
@dataclass
class PerfBulk:
    tensors: list[torch.Tensor]
    stage: bool = False


@message("perftest.Ack")
@dataclass
class PerfAck:
    count: int


@message("perftest.Open")
@dataclass
class PerfOpen:
    tag: str
    info: dict[str, Any]
    bucket_bytes: int
    copy_out: bool
    device: str
    max_size: int


@message("perftest.Recv")
@dataclass
class PerfRecv:
    header: dict[str, Any]


@message("perftest.Close")
@dataclass
class PerfClose:
    reason: str = ""


def _no_weights(name: str) -> torch.Tensor:
    raise SyncError(f"perftest receiver holds no weights (asked for {name!r}); every version is written in full")


class PerfSink(Actor):
    """Receives, counts and (when staging) copies out every message; acks on request."""

    def __init__(self, device: str, max_size: int) -> None:
        self.count = 0
        self.target = -1
        self.reached = asyncio.Event()
        self.receiver: Any = None
        self.copy_out = False
        self.dest = (torch.empty(max_size, dtype=torch.uint8, pin_memory=True) if device == "pinned"
                     else torch.empty(max_size, dtype=torch.uint8, device=device))
        self.local = LocalWeights(0, _no_weights)
        self._slot_sets: dict[tuple[tuple[str, ...], int], LocalWeights] = {}

    def _arrived(self) -> None:
        self.count += 1
        if self.count == self.target:
            self.reached.set()

    def _stage(self, tensors: list[torch.Tensor]) -> None:
        pos = 0
        for t in tensors:
            flat = t.reshape(-1).view(torch.uint8)
            self.dest[pos:pos + flat.numel()].copy_(flat)
            pos += flat.numel()
        sync(self.dest.device)

    @handler(PerfCtl)
    def on_ctl(self, msg: PerfCtl) -> None:
        self._arrived()

    @handler(PerfBulk)
    def on_bulk(self, msg: PerfBulk) -> None:
        if msg.stage:
            self._stage(msg.tensors)
        self._arrived()

    @handler(PerfAck)
    async def on_ack(self, msg: PerfAck) -> int:
        if self.count < msg.count:
            self.target = msg.count
            await self.reached.wait()
        self.reached.clear()
        self.target = -1
        return self.count

    @handler(PerfOpen)
    async def on_open(self, msg: PerfOpen) -> None:
        self.receiver = make_receiver(msg.tag, msg.info, msg.bucket_bytes)
        self.copy_out = msg.copy_out
        await self.receiver.open()

    @handler(PerfRecv)
    async def on_recv(self, msg: PerfRecv) -> None:
        if self.receiver is None:
            raise TransportError("perftest sink: Recv before Open")
        views = await self.receiver.recv(msg.header, self._slots(msg.header))
        if self.copy_out:
            if views and views[0][1].data_ptr() == self.dest.data_ptr():
                sync(self.dest.device)  # the receiver wrote into the destination itself
            else:
                self._stage([t for _, t in views])
        self._arrived()

    def _slots(self, header: dict[str, Any]) -> LocalWeights:
        """Destination slots laid out as the message's bucket, as an engine's staging area is:
        receivers that can write there directly do (the stage copy is then already done)."""
        if not self.copy_out or "layout" not in header:
            return self.local
        wire = header["layout"]
        try:
            key = (tuple(wire["names"]), int(wire["nbytes"]))
        except (KeyError, TypeError, ValueError):
            return self.local  # the receiver reports the malformed layout
        local = self._slot_sets.get(key)
        if local is None:  # once per message shape, not per message: the harness stays off the clock
            local = self._slot_sets[key] = self._slot_set(Layout.from_wire(wire))
        return local

    def _slot_set(self, lay: Layout) -> LocalWeights:
        if lay.nbytes > self.dest.numel():
            return self.local
        views = {n: self.dest[off:off + math.prod(shape) * dtype_of(dt).itemsize].view(dtype_of(dt)).view(shape)
                 for n, dt, shape, off in zip(lay.names, lay.dtypes, lay.shapes, lay.offsets, strict=True)}

        def slot(name: str) -> torch.Tensor:
            if name not in views:
                raise TransportError(f"perftest sink: no slot for {name!r}")
            return views[name]

        return LocalWeights(0, _no_weights, slot)

    @handler(PerfClose)
    async def on_close(self, msg: PerfClose) -> None:
        if self.receiver is not None:
            await self.receiver.close()
            self.receiver = None


def split(t: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """`parts` views covering `t` (the last takes the remainder): the tensors of a bucket."""
    n = t.numel()
    parts = max(1, min(parts, n))
    per = n // parts
    return [t[i * per:(i + 1) * per if i < parts - 1 else n] for i in range(parts)]


@dataclass
class MilesDriver:
    """Rank 0's end of the miles path for one transport and pattern."""

    transport: str
    pattern: str
    ctx: Ctx
    block: int = 1
    host: Host | None = None
    sender: Any = None
    sent: int = 0
    version: int = 0
    _pending: list[Any] = field(default_factory=list)
    _versions: list[int] = field(default_factory=list)

    @property
    def stage(self) -> bool:
        return self.pattern == "bucket"

    async def open(self) -> dict[str, Any]:
        cfg = TransportConfig(interface=self.ctx.bind_host, hwm=100000, max_frame_bytes=max(4 << 30, self.ctx.max_size))
        self.host = Host(cfg)
        await self.host.start()
        await self.host.add(Directory(cfg.heartbeat_timeout_s, cfg.heartbeat_interval_s), DIRECTORY_NAME)
        self.src = payload(self.ctx)
        self.sink = self.host.ref(SINK)
        self._buckets: dict[int, Bucket] = {}
        return {"directory_port": int(self.host.address.rsplit(":", 1)[1])}

    async def connect(self) -> None:
        """Called once the sink is up: open the bulk channel through it."""
        assert self.host is not None
        await self.host.lookup(SINK, self.ctx.timeout_s)
        tag = CHANNEL_TAGS.get(self.transport)
        if tag is None:
            return
        mib = max(1, math.ceil(self.ctx.max_size / (1 << 20)))
        cfg = SyncConfig(transport=tag, bucket_mib=mib, step_timeout_s=self.ctx.timeout_s,
                         delta_dir=f"{self.ctx.directory}/miles" if tag == "disk_delta" else "",
                         delta_compression="none")
        self.sender = make_sender(cfg)
        if hasattr(self.sender, "advertise"):
            self.sender.advertise = self.ctx.peer_host
        if hasattr(self.sender, "device"):
            self.sender.device = self.ctx.dev
        info = (await self.sender.open([SINK]))[0]
        opening = self.sink.ask(PerfOpen(tag, info, self.sender.bucket_bytes, self.stage or tag == "cuda_ipc",
                                         self.ctx.device, self.ctx.max_size), timeout=self.ctx.timeout_s)
        await asyncio.gather(opening, *([self.sender.connected()] if hasattr(self.sender, "connected") else []))

    def _bucket(self, size: int) -> Bucket:
        b = self._buckets.get(size)
        if b is None:
            ts = split(self.src[:size], STAGE_TENSORS if self.stage else 1)
            b = Bucket([f"t{i}" for i in range(len(ts))], ts, size)
            self._buckets = {size: b}
        return b

    async def send(self, size: int) -> None:
        assert self.host is not None
        self.sent += 1
        if self.transport == "zmq-ctl":
            msg: Any = PerfCtl(self._bytes(size))
        elif self.transport == "zmq-bulk":
            msg = PerfBulk(self._bucket(size).tensors, self.stage)
        elif not self.sender.streaming:
            # A block of messages is one version: written now, read after `finish` (in ack).
            if not self._pending:
                self.version += 1
            self._pending.append(PerfRecv(self.sender.prepare(self.version, len(self._pending), self._bucket(size))))
            await self.sender.transmit()
            return
        else:
            msg = PerfRecv(self.sender.prepare(self.version, self.sent, self._bucket(size)))
            if self.block == 1:
                await asyncio.gather(self.sender.transmit(), self.sink.ask(msg, timeout=self.ctx.timeout_s))
                return
            await asyncio.gather(self.sender.transmit(), self.sink.tell(msg))
            return
        if self.block == 1:
            self._pending.append(msg)
        else:
            await self.sink.tell(msg)

    def _bytes(self, size: int) -> bytes:
        b = getattr(self, "_payload_bytes", b"")
        if len(b) != size:
            b = self._payload_bytes = bytes(self.src[:size].numpy())
        return b

    async def ack(self) -> None:
        if self.sender is not None and not self.sender.streaming:
            await self.sender.finish(self.version)
            msgs, self._pending = self._pending, []
            for m in msgs[:-1]:
                await self.sink.tell(m)
            await self.sink.ask(msgs[-1], timeout=self.ctx.timeout_s)
            await self.sink.ask(PerfAck(self.sent), timeout=self.ctx.timeout_s)
            shutil.rmtree(version_dir(self.sender.root, self.version), ignore_errors=True)
            return
        if self._pending:
            msg = self._pending.pop()
            await self.sink.ask(msg, timeout=self.ctx.timeout_s)
        elif self.block > 1:
            await self.sink.ask(PerfAck(self.sent), timeout=self.ctx.timeout_s)

    async def close_channel(self) -> None:
        """Tear the bulk channel down on both ends (before rank 1 stops its host)."""
        closing = [self.sink.ask(PerfClose(), timeout=self.ctx.timeout_s)]
        if self.sender is not None:
            closing.append(self.sender.close())
        await asyncio.gather(*closing)

    async def stop(self) -> None:
        """Stop this host (it runs the directory, so after rank 1 stopped its own)."""
        if self.host is not None:
            await self.host.stop(grace_s=1.0)
            self.host = None


class MilesResponder:
    """Rank 1's end: a host (registered with rank 0's directory) running the sink."""

    def __init__(self, ctx: Ctx, own_ip: str) -> None:
        self.ctx = ctx
        self.own_ip = own_ip
        self.host: Host | None = None

    async def open(self, info: dict[str, Any]) -> None:
        cfg = TransportConfig(interface=self.own_ip, hwm=100000, max_frame_bytes=max(4 << 30, self.ctx.max_size))
        self.host = Host(cfg, f"tcp://{self.ctx.peer_host}:{int(info['directory_port'])}")
        await self.host.start()
        await self.host.add(PerfSink(self.ctx.device, self.ctx.max_size), SINK)

    async def close(self) -> None:
        if self.host is not None:
            await self.host.stop(grace_s=1.0)
            self.host = None
