"""Weight-sync coordinator: trainer -> engines in fixed-size buckets, atomic commit per version.

Protocol per version v: pause (configured mode) -> stage every bucket on every engine
-> commit(v) everywhere -> resume -> optional checksum check. Buckets travel on the
bulk channel named by `sync.transport` (transport/bulk/); the control messages
(open, per-bucket header, commit) always travel over the actor wire. Every step has a
deadline. A live engine that fails or times out aborts v everywhere with a
`SyncError` naming the step and the peer; an engine the directory declares dead is
dropped from this sync, reported, and caught up when it comes back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from miles.actors.messages import AbortVersion, Checksums, Commit, Pause, Resume, Stage
from miles.actors.runtime.host import Host
from miles.actors.sync_messages import BulkClose, BulkOpen, BulkPlan, BulkRecv, FlatRange
from miles.core.errors import ActorDeadError, MilesError, SyncError
from miles.core.logging import get_logger
from miles.core.schema.sync import SyncConfig
from miles.models.hf_io import tensor_checksum
from miles.transport.bulk.base import BulkSender, make_sender
from miles.transport.bulk.buckets import Bucket, iter_buckets
from miles.transport.bulk.coordinator import ShardedCoordinator, ShardedOptions, SyncReport
from miles.transport.bulk.flat import FlatWeights
from miles.transport.bulk.rank_group import RankGroup, TorchRankGroup
from miles.transport.bulk.shard_channels import make_shard_sender
from miles.transport.bulk.shard_plan import ShardExport

log = get_logger("miles.sync")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _advertise(host: Host, cfg: SyncConfig) -> str:
    """The address engines reach this process at: config, else the actor host's TCP address."""
    if cfg.advertise_addr:
        return cfg.advertise_addr
    if host.address.startswith("tcp://"):
        ip = host.address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
        if ip not in ("0.0.0.0", "*", "::"):
            return ip
    return "127.0.0.1"


async def _both(asks: asyncio.Future[Any], tx: asyncio.Future[Any]) -> None:
    """One bucket: the receivers' asks and this side's transmit; the first failure wins.

    The transmit is shared with the next bucket's chain, so it is awaited, never cancelled
    here (the coordinator cancels the chain on failure); the asks are this bucket's alone and
    are cancelled with it, so no reply is awaited for a version being dropped.
    """
    try:
        done, _ = await asyncio.wait([asks, tx], return_when=asyncio.FIRST_EXCEPTION)
        for f in done:
            if not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        await asks
        await asyncio.shield(tx)
    except BaseException:
        asks.cancel()
        raise


class WeightSync:
    """Pushes weight versions to a set of engine actors over the configured bulk channel."""

    def __init__(self, host: Host, cfg: SyncConfig, engines: list[str], device: str | torch.device = "cpu") -> None:
        self.host = host
        self.cfg = cfg
        self.engines = list(engines)
        self.device = torch.device(device)
        self.sender: BulkSender = make_sender(cfg)
        if cfg.transport in ("broadcast", "ucx"):
            # Broadcast picks NCCL for a CUDA trainer, gloo for a CPU one; ucx keeps GPU weights on the GPU.
            self.sender.device = self.device
        if hasattr(self.sender, "advertise"):
            self.sender.advertise = _advertise(host, cfg)
        self._open_for: list[str] | None = None  # engines whose receivers are connected to the sender
        self._plan_for: tuple[Any, ...] | None = None  # (flat plan digest, engines) that hold that plan
        self._plan_ok = False
        self._declined: list[str] = []
        self._ranges: tuple[Any, list[tuple[int, int]]] = (None, [])  # flat byte ranges per (plan, bucket size)
        self.versions: dict[str, int] = {}  # last version each engine committed through this coordinator

    async def _all(self, step: str, names: list[str], make: Callable[[str], Any], dead: list[str]) -> list[Any]:
        """Ask every live engine; a dead one is dropped, any other failure raises SyncError."""

        async def one(name: str) -> Any:
            try:
                return await self.host.ref(name).ask(make(name), timeout=self.cfg.step_timeout_s)
            except ActorDeadError:
                if name not in dead:  # several buckets in flight can each see the same death
                    dead.append(name)
                return None
            except MilesError as exc:
                raise SyncError(f"{step} failed on engine {name!r}: {type(exc).__name__}: {exc}") from exc

        return await asyncio.gather(*(one(n) for n in names))

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
                                       lambda n: BulkOpen(tag, infos[n], nbytes), dead),
                             getattr(self.sender, "connected", None))
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

    def _bucket_msgs(self, version: int, buckets: Iterable[Bucket]) -> Iterator[tuple[int, Callable[[int], Any]]]:
        """(bytes, message maker) per bucket of tensors; the maker prepares bucket `seq` on the channel."""
        snd = self.sender
        for bucket in buckets:
            def make(seq: int, b: Bucket = bucket) -> Any:
                header = snd.prepare(version, seq, b)
                return Stage(version, b.names, b.tensors) if snd.inline else BulkRecv(version, header)
            yield bucket.nbytes, make

    def _flat_msgs(self, version: int, weights: FlatWeights) -> Iterator[tuple[int, Callable[[int], Any]]]:
        """(bytes, message maker) per byte range of a flat export: no per-tensor work."""
        snd, plan = self.sender, weights.plan
        host = snd.inline and weights.buffer.device.type != "cpu"  # zmq carries host memory
        key = (plan.digest, snd.bucket_bytes)
        if self._ranges[0] != key:
            self._ranges = (key, plan.ranges(snd.bucket_bytes))
        for lo, hi in self._ranges[1]:
            def make(seq: int, lo: int = lo, hi: int = hi) -> Any:
                header = snd.prepare_flat(version, seq, lo, hi, weights)
                data = weights.buffer[lo:hi] if snd.inline else None
                return FlatRange(version, plan.digest, lo, hi, header,
                                 data.to("cpu") if host and data is not None else data)
            yield hi - lo, make

    async def _send_plan(self, weights: FlatWeights, live: list[str], rep: SyncReport) -> bool:
        """Give the engines the flat plan (once per plan and engine set); whether all take it.

        An engine answers True, or the reason it declines (None: it died meanwhile). A decline
        sends every later version tensor by tensor, converted: a slow path the user is told
        about, with the engines' reasons, and that `sync/plan_declined` counts."""
        key = (weights.plan.digest, tuple(live))
        if self._plan_for != key:
            wire = weights.plan.to_wire()
            took = await self._all("flat plan", live, lambda _n: BulkPlan(wire), rep.dead)
            why = {n: str(t) for n, t in zip(live, took, strict=True) if t is not True and t is not None}
            self._plan_for, self._plan_ok, self._declined = key, not why, sorted(why)
            if why:
                log.warning("flat_plan_declined", engines=why, consequence="weights go tensor by tensor, converted "
                            "on the engine; set sync.dtype to the engine's dtype ('engine') to keep the fast path")
            else:
                log.info("flat_plan_sent", engines=live, tensors=len(weights.plan.names), bytes=weights.plan.nbytes)
        rep.declined = list(self._declined)
        return self._plan_ok

    async def _send_buckets(self, version: int, msgs: Iterable[tuple[int, Callable[[int], Any]]], live: list[str],
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
                    inflight.append(asyncio.ensure_future(self._all(step, now, lambda _n, m=msg: m, rep.dead)))
                    await asyncio.sleep(0)
                elif snd.streaming:
                    chain = asyncio.ensure_future(after(chain))
                    asks = asyncio.ensure_future(self._all(step, now, lambda _n, m=msg: m, rep.dead))
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
            pending = [*inflight, *([chain] if chain is not None else [])]
            for f in pending:
                f.cancel()
            if pending:  # bounded: a channel call that ignores cancellation must not hang the abort
                await asyncio.wait(pending, timeout=self.cfg.step_timeout_s)
            raise
        return deferred

    async def push(self, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        rep = SyncReport(version, self.sender.tag)
        live = [n for n in self.engines]
        t0 = time.perf_counter()
        dtype = _DTYPES.get(self.cfg.dtype)
        sums: dict[str, str] = {}
        verify = self.cfg.verify_every > 0 and version % self.cfg.verify_every == 0
        paused = False
        snd = self.sender
        try:
            if self.cfg.pause_mode != "none":
                await self._all("pause", live, lambda _n: Pause(self.cfg.pause_mode), rep.dead)
                paused = True
            live = [n for n in live if n not in rep.dead]
            rep.pause_s = time.perf_counter() - t0
            await self._open(live, rep.dead)

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

            if flat is not None and await self._send_plan(flat, live, rep):
                if verify:
                    sums.update((n, tensor_checksum(t)) for n, t in flat)
                msgs, depth = self._flat_msgs(version, flat), snd.flat_window
            else:
                msgs, depth = self._bucket_msgs(version, iter_buckets(converted(), self.cfg.bucket_mib << 20)), 0
            deferred = await self._send_buckets(version, msgs, live, rep, depth)
            await snd.finish(version)
            for seq, msg in enumerate(deferred):  # non-streaming: receivers read after finish
                live = [n for n in live if n not in rep.dead]
                await self._all(f"stage v{version} bucket {seq} ({snd.tag})", live, lambda _n, m=msg: m, rep.dead)
            live = [n for n in live if n not in rep.dead]
            t_staged = time.perf_counter()
            rep.transfer_s = t_staged - t0 - rep.pause_s
            await self._all(f"commit v{version}", live, lambda _n: Commit(version), rep.dead)
            rep.committed = [n for n in live if n not in rep.dead]
            rep.commit_s = time.perf_counter() - t_staged
            await snd.committed(version)
            for n in rep.committed:
                self.versions[n] = version
        except BaseException:
            # Any failure (a channel, a peer, or the trainer's own export raising midway) drops
            # v everywhere: an engine left with v half-staged would refuse every later version.
            self._forget()  # a failed channel is rebuilt on the next push
            await snd.abort(version)
            await self._abort(version, [n for n in live if n not in rep.dead])
            raise
        finally:
            t_resume = time.perf_counter()
            if paused:
                try:
                    await self._all("resume", [n for n in live if n not in rep.dead],
                                    lambda _n: Resume(), rep.dead)
                except SyncError as exc:
                    log.error("resume_failed", error=str(exc))
            rep.resume_s = time.perf_counter() - t_resume
        rep.seconds = time.perf_counter() - t0
        if verify:
            rep.verified = await self.verify(rep.committed, sums)
        if rep.dead:
            self._forget()
            log.warning("sync_engines_dead", version=version, dead=rep.dead)
        return rep

    async def catch_up(self, engine: str, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Bring one (restarted or lagging) engine to `version` with a full copy over the zmq path.

        The engine joins this coordinator's set; the bulk channel is rebuilt on the next push
        so it gets a receiver too. Delta channels need no change: the engine now holds the
        version their next delta is based on.
        """
        cfg = dataclasses.replace(self.cfg, transport="zmq", delta_dir="", pause_mode="none")
        rep = await WeightSync(self.host, cfg, [engine]).push(version, named)
        if engine not in rep.committed:
            raise SyncError(f"catch-up of engine {engine!r} to v{version} failed: it is dead")
        if engine not in self.engines:
            self.engines.append(engine)
        self.versions[engine] = version
        self._forget()
        return rep

    async def close(self) -> None:
        """Tear the channel down on both sides (engines first, so none waits on a gone sender)."""
        if self._open_for:
            dead: list[str] = []
            try:
                await self._all("close channel", self._open_for, lambda _n: BulkClose(), dead)
            except SyncError as exc:
                log.warning("channel_close_failed", error=str(exc))
        self._open_for = None
        await self.sender.close()

    async def _abort(self, version: int, names: list[str]) -> None:
        dead: list[str] = []
        try:
            await self._all(f"abort v{version}", names, lambda _n: AbortVersion(version), dead)
        except SyncError as exc:
            log.error("abort_version_failed", version=version, error=str(exc))

    async def verify(self, engines: list[str], expected: dict[str, str]) -> bool:
        """Compare each engine's per-tensor xxh64 with the trainer's; raise SyncError on mismatch."""
        dead: list[str] = []
        got = await self._all("checksum", engines, lambda _n: Checksums(), dead)
        for name, sums in zip(engines, got, strict=True):
            if sums is None:
                continue
            bad = [k for k, v in expected.items() if sums.get(k) != v]
            if bad:
                raise SyncError(f"checksum mismatch on engine {name!r} for {len(bad)} tensor(s), e.g. {bad[:3]}")
        return True


class ActorEngineLink:
    """The sharded coordinator's EngineLink (transport/bulk/coordinator.py) over the actor wire:
    each step one ask with the step deadline (sync.step_timeout_s)."""

    def __init__(self, host: Host, timeout_s: float) -> None:
        self.host, self.timeout_s = host, timeout_s

    async def _ask(self, engine: str, msg: Any) -> Any:
        return await self.host.ref(engine).ask(msg, timeout=self.timeout_s)

    async def pause(self, engine: str, mode: str) -> None:
        await self._ask(engine, Pause(mode))

    async def resume(self, engine: str) -> None:
        await self._ask(engine, Resume())

    async def open(self, engine: str, tag: str, info: dict[str, Any], bucket_bytes: int) -> None:
        await self._ask(engine, BulkOpen(tag, info, bucket_bytes))

    async def plan(self, engine: str, plan: dict[str, Any]) -> bool | str:
        return await self._ask(engine, BulkPlan(plan))  # type: ignore[no-any-return]

    async def range(self, engine: str, version: int, digest: str, lo: int, hi: int, header: dict[str, Any]) -> int:
        return await self._ask(engine, FlatRange(version, digest, lo, hi, header))  # type: ignore[no-any-return]

    async def commit(self, engine: str, version: int) -> None:
        await self._ask(engine, Commit(version))

    async def abort(self, engine: str, version: int) -> None:
        await self._ask(engine, AbortVersion(version))

    async def checksums(self, engine: str) -> dict[str, str]:
        return await self._ask(engine, Checksums())  # type: ignore[no-any-return]

    async def close(self, engine: str) -> None:
        await self._ask(engine, BulkClose())


class ShardedWeightSync:
    """Every trainer rank's shell of a sharded sync (`sync.sharded`): each rank sends its own
    slices (trainer `export_sharded_state`) straight to every engine; the protocol is
    `ShardedCoordinator`. Every rank constructs one and calls `push` / `catch_up` / `close`
    together (they are collectives over `group`, default: the trainer's torch.distributed group).
    """

    def __init__(self, host: Host, cfg: SyncConfig, engines: list[str], device: str | torch.device = "cpu",
                 group: RankGroup | None = None, bucket_bytes: int | None = None) -> None:
        self.host, self.cfg = host, cfg
        self.device = torch.device(device)
        self.group = group if group is not None else TorchRankGroup("cuda" if self.device.type == "cuda" else "cpu")
        self.advertise = _advertise(host, cfg)
        self.link = ActorEngineLink(host, cfg.step_timeout_s)
        self.opts = ShardedOptions(bucket_bytes or cfg.bucket_mib << 20, cfg.pipeline_depth, cfg.pause_mode,
                                   cfg.verify_every)
        self.coordinator = ShardedCoordinator(self.link, self.group, self._sender(cfg.transport), engines, self.opts)

    def _sender(self, tag: str) -> Any:
        return make_shard_sender(tag, self.group.rank, self.group.size, self.cfg.step_timeout_s, self.advertise,
                                 self.device)

    @property
    def engines(self) -> list[str]:
        return self.coordinator.engines

    async def push(self, version: int, export: ShardExport) -> SyncReport:
        return await self.coordinator.push(version, export)

    async def catch_up(self, engine: str, version: int, export: ShardExport) -> SyncReport:
        """Bring one engine to `version` over zmq, every rank sending its shard (a collective)."""
        return await self.coordinator.catch_up(engine, version, export, self._sender("zmq"))

    async def close(self) -> None:
        await self.coordinator.close()
