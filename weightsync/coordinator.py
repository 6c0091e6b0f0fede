"""Weight-sync coordinators: the protocol between the trainer and the engines, without sockets.

Two coordinators, both plain classes typed against `SyncLink` (the control path to the
engines; the actor wire in miles, weightsync/actor_wire.py) and a bulk channel (transport/bulk/):

- `GatheredCoordinator` (here): one process holds the whole model (trainer rank 0 after the
  gather, or a flat export buffer) and pushes it to every engine.
- `ShardedCoordinator` (weightsync/shard_coordinator.py): every trainer rank sends its own slices.

Protocol per version v: pause (configured mode) -> stage every bucket on every engine
-> commit(v) everywhere -> resume -> optional checksum check. Buckets travel on the
bulk channel named by `sync.transport`; the control calls (open, per-bucket header,
commit) always travel over the link. Every step has a deadline. A live engine that fails
or times out aborts v everywhere with a `SyncError` naming the step and the peer; an
engine the directory declares dead is dropped from this sync, reported, and caught up when
it comes back.

They need nothing of the actor runtime: the link is a Protocol, so the protocol can be read,
and tested, on its own.

What still goes through `GatheredCoordinator`, and why. Over zmq, ucx and (from a CPU
trainer) broadcast, `GatheredSync` (weightsync/trainer_sync.py) pushes every export as a sharded
sync with one rank (`ShardedCoordinator` on weightsync/one_rank.py's `SoloRankGroup`): a flat
export from its own buffer, a tensor-by-tensor one (LoRA adapters, FP8 codes + scales) packed
into one first; tensors of several dtypes and 0-d ones are one-rank plans. The sharded channels
move byte ranges of a flat plan only, into the engine's staging slots, so this coordinator keeps:
- an export whose engines decline its flat plan, sent tensor by tensor: an SGLang engine has no
  staging slots (it hands whole versions to its server); an FP8 engine fed float
  weights quantizes each one on arrival (weightsync/stager.py), a per-tensor step;
- a flat export in another dtype than `sync.dtype`: converted tensor by tensor here;
- the `disk_delta` and `cuda_ipc` channels: no sharded sender (files of per-tensor deltas
  against the engine's live weights; one GPU's IPC handles to the trainer's memory);
- broadcast from a CUDA trainer (NCCL): its one-rank push is not measured on a GPU yet
  (weightsync/trainer_sync.py `ONE_RANK_TRANSPORTS`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch

from miles.core.errors import SyncError
from miles.core.logging import get_logger
from miles.core.schema.sync import SyncConfig
from miles.models.hf_io import tensor_checksum
from miles.transport.bulk.base import BulkSender, make_sender
from miles.transport.bulk.buckets import Bucket, iter_buckets
from miles.weightsync.flat import NO_SLOTS, FlatWeights
from miles.weightsync.push_round import Call, PushRound, SyncReport, each

log = get_logger("miles.sync")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SyncLink(Protocol):
    """The control path to engines, by name (in miles the actor wire: weightsync/actor_wire.py ActorSyncLink).
    Each call has the step deadline; an engine that is gone raises ActorDeadError, any other
    failure a MilesError."""

    async def pause(self, engine: str, mode: str) -> None: ...
    async def resume(self, engine: str) -> None: ...
    async def open(self, engine: str, tag: str, info: dict[str, Any], bucket_bytes: int) -> None: ...
    async def plan(self, engine: str, plan: dict[str, Any]) -> bool | str: ...
    async def stage(self, engine: str, version: int, names: list[str], tensors: list[torch.Tensor]) -> int:
        """Stage one bucket whose tensors ride with the call (zmq)."""
        ...

    async def recv(self, engine: str, version: int, header: dict[str, Any]) -> int:
        """Receive one bucket described by `header` on the open bulk channel and stage it."""
        ...

    async def range(self, engine: str, version: int, digest: str, lo: int, hi: int, header: dict[str, Any],
                    data: torch.Tensor | None = None) -> int:
        """Land bytes of the flat plan `digest`: inline `data`, or on the channel as `header` says."""
        ...
    async def commit(self, engine: str, version: int) -> None: ...
    async def abort(self, engine: str, version: int) -> None: ...
    async def checksums(self, engine: str) -> dict[str, str]: ...
    async def close(self, engine: str) -> None: ...


async def drain(pending: list[asyncio.Future[Any]], timeout_s: float) -> None:
    """After a failed push: cancel what is still in flight and wait for it, bounded (a channel
    call that ignores cancellation must not hang the abort). Buckets that failed meanwhile are
    consumed here: the push raises the first failure, and the others (the same version, being
    aborted) must not surface later as "exception was never retrieved" at garbage collection."""
    for f in pending:
        f.cancel()
    if not pending:
        return
    await asyncio.wait(pending, timeout=timeout_s)
    for f in pending:
        if f.done() and not f.cancelled():
            f.exception()


async def _both(asks: asyncio.Future[Any], tx: asyncio.Future[Any]) -> None:
    """One bucket: the receivers' asks and this side's transmit; the first failure wins.

    The transmit is shared with the next bucket's chain, so it is awaited, never cancelled
    here (the coordinator cancels the chain on failure); the asks are this bucket's alone and
    are cancelled with it, so no reply is awaited for a version being dropped.
    """
    try:
        done, _ = await asyncio.wait([asks, tx], return_when=asyncio.FIRST_EXCEPTION)
        for f in done:
            if not f.cancelled() and (exc := f.exception()) is not None:
                raise exc
        await asks
        await asyncio.shield(tx)
    except BaseException:
        asks.cancel()
        raise


class _Adopting(Protocol):
    engines: list[str]
    versions: dict[str, int]

    def _forget(self) -> None: ...


def adopt(coord: _Adopting, engine: str, version: int, rep: SyncReport) -> None:
    """After a catch-up push: the engine joins the coordinator's set at `version`, and the
    channel is rebuilt on the next push so it gets a receiver too (both coordinators)."""
    if engine not in rep.committed:
        raise SyncError(f"catch-up of engine {engine!r} to v{version} failed: it is dead")
    if engine not in coord.engines:
        coord.engines.append(engine)
    coord.versions[engine] = version
    coord._forget()


class GatheredCoordinator:
    """Pushes weight versions held by one process (trainer rank 0) to engines over `sender`."""

    def __init__(self, link: SyncLink, sender: BulkSender, cfg: SyncConfig, engines: list[str],
                 device: str | torch.device = "cpu") -> None:
        self.link = link
        self.cfg = cfg
        self.engines = list(engines)
        self.device = torch.device(device)
        self.sender = sender
        self._open_for: list[str] | None = None  # engines whose receivers are connected to the sender
        self._plan_for: tuple[Any, ...] | None = None  # (flat plan digest, engines) that hold that plan
        self._plan_ok = False
        self._declined: list[str] = []
        self._ranges: tuple[Any, list[tuple[int, int]]] = (None, [])  # flat byte ranges per (plan, bucket size)
        self.versions: dict[str, int] = {}  # last version each engine committed through this coordinator

    async def _all(self, step: str, names: list[str], call: Call, dead: list[str]) -> list[Any]:
        return await each(step, names, call, dead)

    def _forget(self) -> None:
        """The engine set or a channel changed: reconnect, and resend the flat plan, next push."""
        self._open_for, self._plan_for = None, None

    async def _open(self, live: list[str], dead: list[str]) -> None:
        """(Re)connect the channel when the engine set changed; once per run otherwise."""
        if self.sender.inline or self._open_for == live:
            return
        self._open_for = None
        infos = dict(zip(live, await self.sender.open(live), strict=True))
        tag, nbytes = self.sender.tag, self.sender.bucket_bytes
        await self._together(self._all(f"open {tag} channel", live,
                                       lambda n: self.link.open(n, tag, infos[n], nbytes), dead),
                             self.sender.connected)
        self._open_for = list(live)

    @staticmethod
    async def _together(asks: Any, local: Callable[[], Any] | None) -> None:
        """Run the engines' side and this side of one step at once; the first failure wins."""
        tasks = [asyncio.ensure_future(asks)]
        if local is not None:
            tasks.append(asyncio.ensure_future(local()))
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def _bucket_msgs(self, version: int, buckets: Iterable[Bucket]) -> Iterator[tuple[int, Callable[[int], Call]]]:
        """(bytes, call maker) per bucket of tensors; the maker prepares bucket `seq` on the channel
        and gives the per-engine call that stages it."""
        snd, link = self.sender, self.link
        for bucket in buckets:
            def make(seq: int, b: Bucket = bucket) -> Call:
                header = snd.prepare(version, seq, b)
                if snd.inline:
                    return lambda n: link.stage(n, version, b.names, b.tensors)
                return lambda n: link.recv(n, version, header)
            yield bucket.nbytes, make

    def _flat_msgs(self, version: int, weights: FlatWeights) -> Iterator[tuple[int, Callable[[int], Call]]]:
        """(bytes, call maker) per byte range of a flat export: no per-tensor work."""
        snd, plan, link = self.sender, weights.plan, self.link
        host = snd.inline and weights.buffer.device.type != "cpu"  # zmq carries host memory
        key = (plan.digest, snd.bucket_bytes)
        if self._ranges[0] != key:
            self._ranges = (key, plan.ranges(snd.bucket_bytes))
        for lo, hi in self._ranges[1]:
            def make(seq: int, lo: int = lo, hi: int = hi) -> Call:
                header = snd.prepare_flat(version, seq, lo, hi, weights)
                data = weights.buffer[lo:hi] if snd.inline else None
                data = data.to("cpu") if host and data is not None else data
                return lambda n: link.range(n, version, plan.digest, lo, hi, header, data)
            yield hi - lo, make

    async def _send_plan(self, weights: FlatWeights, live: list[str], rep: SyncReport) -> bool:
        """Give the engines the flat plan (once per plan and engine set); whether all take it.

        An engine answers True, or the reason it declines (None: it died meanwhile). A decline
        sends every later version tensor by tensor, converted: a slow path the user is told
        about, with the engines' reasons, and that `sync/plan_declined` counts."""
        key = (weights.plan.digest, tuple(live))
        if self._plan_for != key:
            wire = weights.plan.to_wire()
            took = await self._all("flat plan", live, lambda n: self.link.plan(n, wire), rep.dead)
            why = {n: str(t) for n, t in zip(live, took, strict=True) if t is not True and t is not None}
            self._plan_for, self._plan_ok, self._declined = key, not why, sorted(why)
            if why:
                # the advice fits a slot mismatch (dtype or layout); an engine without staging slots (an
                # SGLang server's engine: it hands whole versions to the server) only ever takes tensors
                slotless = all(NO_SLOTS in r for r in why.values())
                log.warning("flat_plan_declined", engines=why, consequence=(
                    "weights go tensor by tensor (these engines take no byte ranges)" if slotless else
                    "weights go tensor by tensor, converted on the engine; set sync.dtype to the engine's "
                    "dtype ('engine') to keep the fast path"))
            else:
                log.info("flat_plan_sent", engines=live, tensors=len(weights.plan.names), bytes=weights.plan.nbytes)
        rep.declined = list(self._declined)
        return self._plan_ok

    async def _send_buckets(self, version: int, msgs: Iterable[tuple[int, Callable[[int], Call]]], live: list[str],
                            rep: SyncReport, depth: int = 0) -> list[Any]:
        """Move every bucket, keeping up to `sync.pipeline_depth` of them in flight.

        Bucket i+1 is packed and its header sent while bucket i is still on the wire or being
        staged, so neither the per-bucket reply round trip nor the pack copy sits between two
        transfers. Transmits are chained (a channel moves buckets in order); receivers take
        headers in order (their handler runs one at a time). Returns the messages of a
        non-streaming channel, whose receivers read after `finish`. `depth` overrides the
        pipeline depth (0: `sync.pipeline_depth`).
        """
        snd = self.sender
        depth = depth or self.cfg.pipeline_depth
        inflight: deque[asyncio.Future[Any]] = deque()
        chain: asyncio.Future[Any] | None = None
        deferred: list[Any] = []

        async def after(prev: asyncio.Future[Any] | None) -> None:
            if prev is not None:
                await prev
            await snd.transmit()

        try:
            for seq, (nbytes, make) in enumerate(msgs):
                while len(inflight) >= depth:
                    await inflight.popleft()  # frees the sender buffer bucket `seq` will use
                now = [n for n in live if n not in rep.dead]
                step = f"stage v{version} bucket {seq} ({snd.tag})"
                msg = make(seq)
                if snd.inline:
                    inflight.append(asyncio.ensure_future(self._all(step, now, msg, rep.dead)))
                    await asyncio.sleep(0)
                elif snd.streaming:
                    chain = asyncio.ensure_future(after(chain))
                    asks = asyncio.ensure_future(self._all(step, now, msg, rep.dead))
                    inflight.append(asyncio.ensure_future(_both(asks, chain)))
                    await asyncio.sleep(0)  # let the asks go out now, not after the whole window is built
                else:
                    await snd.transmit()
                    deferred.append(msg)
                rep.bytes += nbytes
                rep.buckets += 1
            while inflight:
                await inflight.popleft()
        except BaseException:
            await drain([*inflight, *([chain] if chain is not None else [])], self.cfg.step_timeout_s)
            raise
        return deferred

    async def push(self, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        rnd = PushRound(self.link, version, self.sender.tag, self.engines)
        rep = rnd.rep
        dtype = _DTYPES.get(self.cfg.dtype)
        sums: dict[str, str] = {}
        verify = self.cfg.verify_every > 0 and version % self.cfg.verify_every == 0
        snd = self.sender

        async def body() -> None:
            await rnd.pause(self.cfg.pause_mode)
            rnd.mark_paused()
            await self._open(rnd.alive(), rnd.dead)

            host_only = self.cfg.transport in ("zmq", "disk_delta") or (
                self.cfg.transport == "ucx" and self.device.type == "cpu")
            flat = named if isinstance(named, FlatWeights) and snd.flat and (
                dtype is None or all(d == self.cfg.dtype for d in named.plan.dtypes)) else None

            def converted() -> Iterable[tuple[str, torch.Tensor]]:
                for n, t in named:
                    t = t.to(dtype) if dtype is not None else t
                    if host_only and t.device.type != "cpu":
                        t = t.to("cpu")  # these channels carry host memory; GPU paths use NCCL/IPC
                    if verify:  # whole tensors, before any chunking, as the engine holds them
                        sums[n] = tensor_checksum(t)
                    yield n, t

            if flat is not None and await self._send_plan(flat, rnd.alive(), rep):
                if verify:
                    sums.update((n, tensor_checksum(t)) for n, t in flat)
                msgs, depth = self._flat_msgs(version, flat), snd.flat_window
            else:
                msgs, depth = self._bucket_msgs(version, iter_buckets(converted(), self.cfg.bucket_mib << 20)), 0
            deferred = await self._send_buckets(version, msgs, rnd.alive(), rep, depth)
            await snd.finish(version)
            for seq, msg in enumerate(deferred):  # non-streaming: receivers read after finish
                await self._all(f"stage v{version} bucket {seq} ({snd.tag})", rnd.alive(), msg, rnd.dead)
            rnd.mark_staged()
            await rnd.commit()
            rnd.mark_committed()
            await snd.committed(version)
            for n in rep.committed:
                self.versions[n] = version

        async def on_failure(exc: BaseException) -> None:
            # Any failure (a channel, a peer, or the trainer's own export raising midway) drops
            # v everywhere: an engine left with v half-staged would refuse every later version.
            await snd.abort(version)
            await rnd.abort()

        await rnd.run(body, on_failure, self._forget)
        if verify:
            rep.verified = await self.verify(rep.committed, sums)
        return rep

    async def catch_up(self, engine: str, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Bring one (restarted or lagging) engine to `version` with a full copy over the zmq path.

        The engine joins this coordinator's set; the bulk channel is rebuilt on the next push
        so it gets a receiver too. Delta channels need no change: the engine now holds the
        version their next delta is based on.
        """
        cfg = dataclasses.replace(self.cfg, transport="zmq", delta_dir="", pause_mode="none")
        rep = await GatheredCoordinator(self.link, make_sender(cfg), cfg, [engine]).push(version, named)
        adopt(self, engine, version, rep)
        return rep

    async def close(self) -> None:
        """Tear the channel down on both sides (engines first, so none waits on a gone sender)."""
        if self._open_for:
            dead: list[str] = []
            try:
                await self._all("close channel", self._open_for, self.link.close, dead)
            except SyncError as exc:
                log.warning("channel_close_failed", error=str(exc))
        self._open_for = None
        await self.sender.close()

    async def verify(self, engines: list[str], expected: dict[str, str]) -> bool:
        """Compare each engine's per-tensor xxh64 with the trainer's; raise SyncError on mismatch."""
        dead: list[str] = []
        got = await self._all("checksum", engines, self.link.checksums, dead)
        for name, sums in zip(engines, got, strict=True):
            if sums is None:
                continue
            bad = [k for k, v in expected.items() if sums.get(k) != v]
            if bad:
                raise SyncError(f"checksum mismatch on engine {name!r} for {len(bad)} tensor(s), e.g. {bad[:3]}")
        return True
