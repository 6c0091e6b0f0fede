"""The engine's receiver of a sharded weight sync: buckets from every trainer rank.

Every trainer rank sends its own bytes with its channel's sender (transport/bulk/base.py
`BulkSender`, the same classes a gathered sync uses; a gathered flat export is a one-rank
sharded sync). One `ShardReceiver` per engine takes buckets from every rank. Control (which
byte ranges a bucket holds, from which rank) rides in the `FlatRange` header over the actor
wire; the bytes go on the channel:

- `zmq`: inline in the header, as a zero-copy frame of the rank's send buffer.
- `ucx`: one endpoint per (rank, engine) pair; each rank listens, each engine connects to
  every rank. A pair's buckets go in order on its endpoint. An engine handles the bucket
  headers one at a time, and a large UCX message only moves once its receive is posted (a
  rendezvous), so posting each receive when its header comes up would move one rank's bytes
  at a time into an engine while the other ranks wait. Instead the receiver keeps the next
  receive of up to `ahead_bytes // bucket` ranks posted into a bucket buffer of their own
  (receive-ahead): every rank's bytes flow at once, and a header lands what already arrived.
  Ranks beyond that budget are received when their header comes up, as before.
- `broadcast`: one torch.distributed group of every trainer rank and engine (gloo on CPU,
  NCCL on GPU) and send/recv per pair (transport/bulk/broadcast.py says why not broadcasts);
  from one sending rank (a gathered flat export) one broadcast per bucket to every engine.

A receiver lands a bucket's bytes in the engine's staging slots through the flat plan's
landing (weightsync/flat.py): straight into the slots when the bucket is one range and
the slots are laid out like the plan, else through its bucket buffer, range by range.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import torch

from miles.core.errors import SyncError
from miles.core.logging import get_logger
from miles.transport.bulk.base import BulkReceiver, LocalWeights
from miles.transport.bulk.shard_delta import decode

log = get_logger("miles.bulk.sharded")
SHARDED_TAG = "sharded"  # the receiver tag engines open (BulkOpen.transport)


def parse_ranges(raw: Any) -> list[tuple[int, int, int, int]]:
    """A bucket header's destination ranges as (lo, width, stride, count) blocks: [lo, hi] is
    one run, [lo, width, stride, count] `count` runs `stride` apart (shard_plan.ShardBucket.ranges)."""
    out = []
    for r in raw:
        if len(r) == 2:
            lo, hi = int(r[0]), int(r[1])
            out.append((lo, hi - lo, hi - lo, 1))
        elif len(r) == 4:
            out.append((int(r[0]), int(r[1]), int(r[2]), int(r[3])))
        else:
            raise ValueError(f"a range has {len(r)} fields (2 or 4)")
    return out


def land_blocks(landing: Any, local: LocalWeights, blocks: list[tuple[int, int, int, int]],
                data: torch.Tensor) -> list[str]:
    """Land a bucket's bytes (`data`, in block order) into the staging slots. A strided block
    is one strided copy when the slots are laid out like the plan, else one copy per run."""
    names: list[str] = []
    pos = 0
    region = None
    for lo, w, st, c in blocks:
        n = w * c
        if c > 1 and region is None:
            region = landing.region(local)
        if c > 1 and region is not None and region.device == data.device:
            region.as_strided((c, w), (st, 1), lo).copy_(data[pos:pos + n].view(c, w), non_blocking=True)
            names += landing.plan.done_in(lo, lo + st * (c - 1) + w)
        else:
            for i in range(c):
                a = lo + i * st
                names += landing.land(a, a + w, data[pos + i * w:pos + (i + 1) * w], local)
        pos += n
    return names


class ShardReceiver(BulkReceiver):
    """Engine side: buckets from every trainer rank, landed through the flat plan's landing.

    `info`: {"channel": zmq | ucx | broadcast, "sources": [per trainer rank: its open info],
    "timeout_s": s}; broadcast adds the group (rank 0's source info names it)."""

    tag = SHARDED_TAG

    def __init__(self, info: dict[str, Any], bucket_bytes: int) -> None:
        super().__init__(info, bucket_bytes)
        self.channel = str(info.get("channel", ""))
        if self.channel not in ("zmq", "ucx", "broadcast"):
            raise SyncError(f"sharded receiver: unknown channel {self.channel!r}")
        self.sources: list[dict[str, Any]] = list(info.get("sources", []))
        self.timeout_s = float(info.get("timeout_s", 120.0))
        self._eps: list[Any] = []
        # receive-ahead (ucx): per trainer rank, its bucket buffer and the receive posted into it
        self._ahead: dict[int, tuple[torch.Tensor, asyncio.Future[Any]]] = {}
        self._broken = ""  # why the receive-ahead stream broke, if it did
        self._pg: Any = None
        self._store: Any = None
        # GPU weights land through GPU buffers (NCCL, or UCX moving CUDA memory itself), as a gathered
        # ucx receiver's do: the senders say where their bytes live.
        first = self.sources[0] if self.sources else {}
        dev = "cuda" if first.get("backend") == "nccl" or first.get("mem") == "cuda" else "cpu"
        self._buf = torch.empty(0, dtype=torch.uint8, device=dev)  # grown to a bucket on first need
        self._full = torch.empty(0, dtype=torch.uint8, device=dev)  # a delta bucket rebuilt (delta syncs only)

    async def open(self) -> None:
        try:
            if self.channel == "ucx":
                from miles.transport.bulk.ucx import import_ucxx

                ucxx = import_ucxx()
                index = int(self.info["index"])
                for s in self.sources:
                    ep = await ucxx.create_endpoint(str(s["addr"]), int(s["port"]))
                    await ep.send(np.array([index], dtype=np.int64))
                    self._eps.append(ep)
                slots = min(len(self._eps), int(self.info.get("ahead_bytes", 0)) // max(self.bucket_bytes, 1))
                for src in range(slots):
                    self._post(src, torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self._buf.device))
            elif self.channel == "broadcast":
                from miles.transport.bulk.broadcast import _group, _joined, member_device

                s = self.sources[0]
                rank, backend = int(s["rank"]), str(s["backend"])
                who = f"engine {s.get('member', f'#{rank}')!r}"
                me = member_device(backend, rank, who, self._buf.device)  # under NCCL: one GPU per member, checked
                self._store, self._pg = await _joined(asyncio.to_thread(
                    _group, backend, str(s["addr"]), int(s["port"]), rank, int(s["world"]), self.timeout_s, me),
                    self.timeout_s, who)
        except (KeyError, IndexError, ValueError) as exc:
            raise SyncError(f"sharded {self.channel} open info is malformed: {exc}") from exc
        except RuntimeError as exc:
            raise SyncError(f"sharded {self.channel}: connecting to the trainer ranks failed: {exc}") from exc

    async def recv(self, header: dict[str, Any], local: LocalWeights) -> list[tuple[str, torch.Tensor]]:
        raise SyncError("a sharded channel moves flat byte ranges only (the engine must take the flat plan)")

    def _post(self, src: int, buf: torch.Tensor) -> None:
        """Post the receive of trainer rank `src`'s next bucket into `buf` (a bucket or more: a
        shorter message fills its head), awaited by the header that names it."""
        from miles.transport.bulk.ucx import ucx_buffer, ucx_wait

        ub = ucx_buffer(buf)
        self._ahead[src] = (buf, asyncio.ensure_future(ucx_wait(self._eps[src].recv(ub), ub)))

    async def _take_ahead(self, src: int, wire: int) -> torch.Tensor:
        """Rank `src`'s next bucket (`wire` bytes), from the receive posted ahead for it."""
        buf, fut = self._ahead[src]
        if wire > buf.numel():
            raise SyncError(f"ucx (sharded): a bucket of {wire} bytes from trainer rank {src} exceeds the "
                            f"{buf.numel()}-byte bucket its receive was posted for")
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except TimeoutError:
            raise SyncError(f"ucx (sharded): receiving {wire} bytes from trainer rank {src} did not complete "
                            f"within {self.timeout_s}s") from None
        except Exception as exc:  # noqa: BLE001 - the endpoint failed: this channel is done (reopened next push)
            raise SyncError(f"ucx (sharded): receiving from trainer rank {src} failed: {exc}") from exc
        return buf[:wire]

    def _repost(self, src: int) -> None:
        """The bucket from `src` is landed: its buffer takes the rank's next bucket."""
        buf = self._ahead[src][0]
        if buf.device.type == "cuda":
            torch.cuda.current_stream(buf.device).synchronize()  # the landing copies read it on the stream
        self._post(src, buf)

    async def _take(self, src: int, seq: int, dst: torch.Tensor, collective: bool = False) -> None:
        if self.channel == "ucx":
            from miles.transport.bulk.ucx import ucx_buffer, ucx_transfer

            await ucx_transfer(self._eps[src].recv, ucx_buffer(dst), self.timeout_s,
                               f"ucx (sharded): receiving {dst.numel()} bytes from trainer rank {src}")
        else:
            if self._pg is None:
                raise SyncError("broadcast (sharded): receive before open")
            from miles.transport.bulk.broadcast import _broadcast_all, _wait

            what = f"broadcast (sharded): receiving {dst.numel()} bytes from trainer rank {src}"
            if not collective:  # several sending ranks: send/recv per pair
                await _wait(self._pg.recv([dst], src, seq), what, self.timeout_s)
                return
            try:  # one sending rank (0) broadcasts each bucket to every engine; completes through its future
                await _broadcast_all(self._pg, [dst], self.timeout_s, what)
            except RuntimeError as exc:
                raise SyncError(f"{what} failed: {exc}") from exc

    async def recv_flat(self, header: dict[str, Any], landing: Any, local: LocalWeights) -> list[str]:
        try:
            src, seq = int(header["src"]), int(header["seq"])
            blocks = parse_ranges(header["ranges"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SyncError(f"sharded bucket header is malformed: {exc}") from exc
        total = sum(w * c for _, w, _, c in blocks)
        delta = "delta" in header  # (indices, words) against the live version: shard_delta.py
        collective = bool(header.get("collective"))  # broadcast from one sending rank to every engine
        wire = int(header.get("nbytes", total))
        if any(not (lo >= 0 and w > 0 and c > 0 and (c == 1 or st >= w) and lo + st * (c - 1) + w <= landing.plan.nbytes)
               for lo, w, st, c in blocks) or (wire != total and not delta):
            raise SyncError(f"sharded bucket from rank {src}: its ranges do not fit the plan's {landing.plan.nbytes} "
                            f"bytes or its {wire} bytes on the wire")
        ranges = [(lo + i * st, lo + i * st + w) for lo, w, st, c in blocks for i in range(c)] \
            if delta or len(blocks) == 1 and blocks[0][3] == 1 else []  # per-run form: deltas, one range
        if self.channel == "zmq":
            data = header.get("data")
            if not isinstance(data, torch.Tensor) or data.numel() * data.element_size() != wire:
                raise SyncError(f"sharded zmq bucket from rank {src}: its data does not hold the {wire} bytes "
                                "its header names")
            data = data.reshape(-1).view(torch.uint8)
        elif src in self._ahead:
            if self._broken:
                raise SyncError(f"ucx (sharded): this channel failed earlier ({self._broken}); it is reopened "
                                "at the next push")
            try:
                data = await self._take_ahead(src, wire)
                if delta:
                    if self._full.numel() < total:
                        self._full = torch.empty(max(total, self.bucket_bytes), dtype=torch.uint8, device=data.device)
                    data = decode(header, data, ranges, landing, local, self._full)
                names = land_blocks(landing, local, blocks, data)
            except BaseException as exc:
                # The rank's posted receive may still be pending or hold a bucket nobody landed: no later
                # header may read it (the coordinator reopens the channel after a failed version).
                self._broken = f"rank {src}: {type(exc).__name__}"
                raise
            self._repost(src)
            return names
        else:
            region = landing.region(local)
            if not delta and len(ranges) == 1 and region is not None and region.device == self._buf.device:
                lo, hi = ranges[0]
                await self._take(src, seq, region[lo:hi], collective)  # straight into the staging slots
                return landing.plan.done_in(lo, hi)
            if self._buf.numel() < wire:
                self._buf = torch.empty(max(wire, self.bucket_bytes), dtype=torch.uint8, device=self._buf.device)
            data = self._buf[:wire]
            await self._take(src, seq, data, collective)
        if delta:
            if self._full.numel() < total:
                self._full = torch.empty(max(total, self.bucket_bytes), dtype=torch.uint8, device=self._buf.device)
            data = decode(header, data, ranges, landing, local, self._full)
        return land_blocks(landing, local, blocks, data)

    async def close(self) -> None:
        ahead, self._ahead = [f for _, f in self._ahead.values()], {}
        for f in ahead:
            f.cancel()
        if ahead:
            await asyncio.gather(*ahead, return_exceptions=True)
        for ep in self._eps:
            await ep.close()
        self._eps = []
        if self._pg is not None:
            from miles.transport.bulk.broadcast import _shutdown

            await asyncio.to_thread(_shutdown, self._pg)
        self._pg = None
        self._store = None
