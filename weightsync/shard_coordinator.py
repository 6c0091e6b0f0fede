"""Sharded weight-sync coordinator (the gathered one and the contracts: coordinator.py): every trainer rank sends its own bytes; no rank holds the model.

A plain class, readable and testable without sockets: it talks to engines through an
`SyncLink` (the actor wire in miles: weightsync/actor_wire.py) and to the other trainer ranks
through a `RankGroup` (weightsync/rank_group.py). Every rank runs one; rank 0 also
drives the engines' control steps.

Per version v (every rank calls `push(v, export)`; each phase ends in one all_gather of
every rank's outcome, so a failure anywhere takes every rank down the same path):

1. rank 0 pauses the engines (sync.pause_mode) and decides whether the channel is (re)opened
   (the engine set changed) and whether the plan is (re)sent;
2. open: every rank opens its sender, rank 0 hands every engine the ranks' connect infos;
   rank 0 sends the engines the flat plan (the whole model's HF layout) once per plan;
3. send: every rank moves its buckets (weightsync/shard_plan.py) to every live engine,
   up to sync.pipeline_depth in flight, each (rank, engine) pair in order;
4. commit on rank 0 when every rank delivered every bucket, else abort v on every engine;
5. resume; every N versions, verify the engines' per-tensor checksums.

Guarantees kept from the gathered path: fixed-size buckets, atomic commit (engines swap only
a complete version), a deadline per engine step, abort everywhere on any failure (a channel,
a peer, a rank's own error), a dead engine dropped and reported, checksum verification.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from miles.core.errors import SyncError
from miles.core.logging import get_logger
from miles.transport.bulk.base import BulkSender
from miles.transport.bulk.shard_delta import IDX_BYTES, encode
from miles.transport.bulk.shard_receiver import SHARDED_TAG
from miles.weightsync.coordinator import SyncLink, adopt, drain
from miles.weightsync.push_round import PushRound, SyncReport, each
from miles.weightsync.rank_group import RankGroup
from miles.weightsync.shard_plan import ShardBucket, ShardExport, TransferPlan

log = get_logger("miles.sync.sharded")


def bucket_bytes(buffer: torch.Tensor, b: ShardBucket) -> torch.Tensor:
    """A bucket's bytes: a view of the send buffer when its runs lie back to back there
    (whole-model engines, column blocks too), else packed (one bucket of extra memory)."""
    span = b.contiguous_src()
    if span is not None:
        return buffer[span[0]:span[1]]
    return torch.cat([buffer[s:s + n] for s, _, n in b.runs])


Run = tuple[int, int, int, int, str]  # (dst, owner rank, src, bytes, HF name)
ALL = ""  # the chain key of a fan-out channel's transfers (one per bucket for every engine)


def _coalesce(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(src, bytes) runs with neighbours in the send buffer merged."""
    out: list[tuple[int, int]] = []
    for s, n in runs:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((s, n))
    return out


def _gather_runs(buf: torch.Tensor, runs: list[tuple[int, int]], out: torch.Tensor) -> torch.Tensor:
    """The runs' bytes back to back in `out` (in place); returns the filled prefix."""
    k = 0
    for s, n in runs:
        out[k:k + n].copy_(buf[s:s + n])
        k += n
    return out[:k]


def verify_windows(plan: TransferPlan, window: int) -> list[list[Run]]:
    """Group 0's bytes in plan (HF) order as runs, cut into windows of at most `window` bytes."""
    runs = sorted((d, p.rank, s, n, p.hf_name) for ps in plan.pieces for p in ps if p.group == 0
                  for s, d, n in p.runs())
    out: list[list[Run]] = [[]]
    size = 0
    for d, owner, s, n, name in runs:
        while n:
            take = min(n, window - size)
            out[-1].append((d, owner, s, take, name))
            d, s, n, size = d + take, s + take, n - take, size + take
            if size == window:
                out.append([])
                size = 0
    return [w for w in out if w]


@dataclass
class ShardedOptions:
    bucket_bytes: int
    pipeline_depth: int = 2
    pause_mode: str = "none"
    verify_every: int = 0
    delta: bool = False  # send only changed words when fewer bytes (transport/bulk/shard_delta.py); +1 shard of memory
    receive_ahead_bytes: int = 0  # ucx engines: a bucket per rank, up to this much (transport/bulk/shard_receiver.py)


class _Failed(SyncError):
    pass


class ShardedCoordinator:
    """One trainer rank's side of a sharded sync to `engines` (every rank has the same list)."""

    def __init__(self, link: SyncLink, group: RankGroup, sender: BulkSender, engines: list[str],
                 opts: ShardedOptions) -> None:
        self.link, self.group, self.sender, self.opts = link, group, sender, opts
        self.engines = list(engines)
        self.rank = group.rank
        self._open_for: list[str] | None = None
        self._plan_for: tuple[str, tuple[str, ...]] | None = None
        self._buckets: tuple[Any, list[ShardBucket]] = (None, [])
        self._windows: tuple[Any, list[list[Run]]] = (None, [])  # verify's, per plan
        self.versions: dict[str, int] = {}
        self._prev: torch.Tensor | None = None  # delta base: this rank's send buffer at version `_base`
        self._base = -1

    # ------------------------------------------------------------------ helpers
    async def _each(self, step: str, names: list[str], call: Callable[[str], Awaitable[Any]],
                    dead: list[str]) -> list[Any]:
        return await each(step, names, call, dead)

    async def _phase(self, name: str, local: Callable[[], Awaitable[Any]] | None, dead: list[str]) -> list[Any]:
        """Run this rank's part of a phase, then agree with every rank on its outcome: every rank's
        result in rank order, or _Failed on every rank when any of them failed."""
        err = res = None
        try:
            if local is not None:
                res = await local()
        except Exception as exc:  # noqa: BLE001 - reported to every rank, which all abort with it
            err = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        got = await self.group.all_gather({"err": err, "dead": dead, "res": res})
        for g in got:
            dead.extend(d for d in g["dead"] if d not in dead)
        errs = [g["err"] for g in got if g["err"]]
        if errs:
            raise _Failed(f"{name}: " + "; ".join(errs))
        return [g["res"] for g in got]

    def _forget(self) -> None:
        self._open_for, self._plan_for = None, None

    def forget_engine(self, engine: str) -> None:
        """`engine` came back without its weights (restarted): rank 0 reopens the channel and resends
        the plan to every engine on the next push, which sends it the whole version (no delta)."""
        self.versions.pop(engine, None)
        self._forget()

    async def offer_plan(self, plan: TransferPlan, live: list[str], dead: list[str]) -> dict[str, str]:
        """Rank 0: hand `live` engines the flat plan (once per plan and engine set); the engines that
        declined it, with their reasons (empty: all took it). Inside a push a decline fails the
        push; a one-rank sync (weightsync/one_rank.py) asks before pushing and sends a decliner
        tensors instead (weightsync/trainer_sync.py `GatheredSync`)."""
        if self._plan_for == (plan.digest, tuple(live)):
            return {}
        wire = plan.engines[0].plan.to_wire()
        took = await self._each("flat plan", live, lambda n: self.link.plan(n, wire), dead)
        why = {n: str(t) for n, t in zip(live, took, strict=True) if t is not True and t is not None}
        if not why:
            self._plan_for = (plan.digest, tuple(n for n in live if n not in dead))
        return why

    # ------------------------------------------------------------------ the protocol
    async def push(self, version: int, export: ShardExport) -> SyncReport:
        """Push `version` from every rank's `export` (a collective: every rank calls it)."""
        rnd = PushRound(self.link, version, self.sender.tag, self.engines)
        rep, dead = rnd.rep, rnd.dead
        verify = self.opts.verify_every > 0 and version % self.opts.verify_every == 0
        plan = export.plan

        async def begin() -> dict[str, Any]:
            await rnd.pause(self.opts.pause_mode)
            now = rnd.alive()
            shared = await self.sender.setup(now) if self._open_for != now else None
            # Deltas only against a version every live engine committed through this coordinator
            # (a restarted engine, or a failed push, gets the full bytes); rank 0 decides for all.
            base = self._base if self.opts.delta and self._prev is not None and now and all(
                self.versions.get(n) == self._base for n in now) else None
            return {"live": list(now), "shared": shared, "base": base}

        async def send_plan() -> None:
            why = await self.offer_plan(plan, rnd.alive(), dead)
            if why:
                raise SyncError(f"engines declined the sharded plan (a sharded sync lands byte ranges only; "
                                f"set sync.dtype to the engines' dtype): {why}")

        async def body() -> None:
            ctl = (await self._phase("pause", begin if self.rank == 0 else None, dead))[0]
            rnd.live = ctl["live"]
            rnd.mark_paused()
            if ctl["shared"] is not None:
                await self._open(rnd.alive(), ctl["shared"], dead)
            await self._phase("plan", send_plan if self.rank == 0 else None, dead)
            base = ctl["base"] if self._prev is not None else None
            live = list(rnd.alive())
            sent = await self._phase("send", lambda: self._send(version, export, live, dead, base), dead)
            rep.bytes = sum(s["bytes"] for s in sent)
            rep.full_bytes = sum(s["full"] for s in sent)
            rep.buckets = sum(s["buckets"] for s in sent)
            rnd.mark_staged()
            await self._phase("commit", rnd.commit if self.rank == 0 else None, dead)
            for n in rnd.mark_committed():
                self.versions[n] = version
            if self.opts.delta:
                if self._prev is None or self._prev.shape != export.buffer.shape:
                    self._prev = torch.empty_like(export.buffer)
                self._prev.copy_(export.buffer)
                self._base = version

        async def on_failure(exc: BaseException) -> None:
            self._prev, self._base = None, -1  # the next version goes in full
            if self.rank == 0:
                await rnd.abort()
            if isinstance(exc, _Failed):
                raise SyncError(f"sharded sync of v{version} aborted: {exc}") from None

        await rnd.run(body, on_failure, self._forget)
        if verify:
            rep.verified = await self.verify(export, rep.committed)
        return rep

    async def _open(self, live: list[str], shared: dict[str, Any], dead: list[str]) -> None:
        """Every rank opens its sender; rank 0 gives each engine every rank's connect info."""
        self._open_for = None
        infos = await self._phase("open", lambda: self.sender.open(live, shared), dead)

        async def connect() -> None:
            if self.rank != 0:
                await self.sender.connected()
                return

            def info(i: int) -> dict[str, Any]:
                return {"channel": self.sender.tag, "index": i, "timeout_s": self.sender.timeout_s,
                        "ahead_bytes": self.opts.receive_ahead_bytes,
                        "sources": [infos[r][i] for r in range(self.group.size)]}

            asks = asyncio.ensure_future(self._each(
                f"open sharded {self.sender.tag} channel", live,
                lambda n: self.link.open(n, SHARDED_TAG, info(live.index(n)), self.opts.bucket_bytes), dead))
            mine = asyncio.ensure_future(self.sender.connected())
            try:
                await asyncio.gather(asks, mine)
            except BaseException:
                for t in (asks, mine):
                    t.cancel()
                await asyncio.gather(asks, mine, return_exceptions=True)
                raise

        await self._phase("connect", connect, dead)
        self._open_for = list(live)

    async def _send(self, version: int, export: ShardExport, live: list[str], dead: list[str],
                    base: int | None = None) -> dict[str, int]:
        """This rank's buckets to every live engine: up to pipeline_depth buckets in flight, each
        (rank, engine) pair's transfers chained in order (an engine lands the buckets it is told
        of in header order; chaining per pair, not per bucket, leaves no wait cycle between ranks)."""
        plan = export.plan
        key = (plan.digest, self.opts.bucket_bytes)
        if self._buckets[0] != key:
            self._buckets = (key, plan.buckets(self.rank, 0, self.opts.bucket_bytes))
        buckets = self._buckets[1]
        chains: dict[str, asyncio.Future[Any] | None] = {}  # per engine; ALL: a fan-out channel's one chain
        fan = self.sender.fanout
        inflight: deque[asyncio.Future[Any]] = deque()
        digest = plan.engines[0].plan.digest
        word = plan.trainer.word
        total = wire = 0

        async def move(prev: asyncio.Future[Any] | None, i: int, seq: int, data: torch.Tensor) -> None:
            if prev is not None:
                await prev
            await self.sender.send(i, seq, data)

        async def move_all(prev: asyncio.Future[Any] | None, seq: int, data: torch.Tensor) -> None:
            if prev is not None:
                await prev
            await self.sender.send_all(seq, data)

        async def both(ask: asyncio.Future[Any], tx: asyncio.Future[Any]) -> None:
            try:
                await asyncio.gather(ask, asyncio.shield(tx))
            except BaseException:
                ask.cancel()
                raise

        try:
            for seq, b in enumerate(buckets):
                while len(inflight) >= self.opts.pipeline_depth:
                    await inflight.popleft()
                data = self._bucket_bytes(export, b)
                extra: dict[str, Any] = {}
                span = b.contiguous_src()
                if base is not None and span is not None and self._prev is not None and data.numel() % word == 0:
                    enc = encode(data, self._prev[span[0]:span[1]], word)
                    if enc is not None:
                        extra = {"delta": {"base": base, "word": word, "n": enc.numel() // (IDX_BYTES + word)}}
                        data = enc
                header = {**self.sender.header(seq, data), "ranges": b.ranges, **extra}
                wire += data.numel()
                lo, hi = b.runs[0][1], b.runs[-1][1] + b.runs[-1][2]
                per = []

                def ranged(n: str, h: dict[str, Any] = header, a: int = lo, z: int = hi) -> Awaitable[int]:
                    return self.link.range(n, version, digest, a, z, h)  # this bucket's, bound now

                every = None
                if fan:  # one transfer per bucket reaches every engine; each engine's ask waits on it
                    every = chains[ALL] = asyncio.ensure_future(move_all(chains.get(ALL), seq, data))
                for name in [n for n in live if n not in dead]:
                    i = live.index(name)
                    tx = every if every is not None else asyncio.ensure_future(move(chains.get(name), i, seq, data))
                    chains[name] = tx
                    ask = asyncio.ensure_future(self._each(
                        f"stage v{version} bucket {seq} of rank {self.rank} ({self.sender.tag})", [name],
                        ranged, dead))
                    per.append(both(ask, tx))
                inflight.append(asyncio.ensure_future(asyncio.gather(*per)))
                total += b.nbytes
                await asyncio.sleep(0)  # the headers go out now, not after the window is built
            while inflight:
                await inflight.popleft()
        except BaseException:
            await drain([*inflight, *(c for c in chains.values() if c is not None)], self.sender.timeout_s)
            raise
        return {"bytes": wire, "full": total, "buckets": len(buckets)}

    def _bucket_bytes(self, export: ShardExport, b: ShardBucket) -> torch.Tensor:
        return bucket_bytes(export.buffer, b)

    # ------------------------------------------------------------------ verify, catch-up, close
    async def verify(self, export: ShardExport, engines: list[str]) -> bool:
        """Compare each engine's per-tensor xxh64 with the trainer's (a collective).

        No rank holds a whole tensor, so rank 0 hashes each tensor by streaming its bytes in
        HF order, one window of at most a bucket at a time: per window, every other owner
        sends its runs in it as one message (a column block's rows interleave the TP ranks
        row by row; a message per run would be one per row). Only verify versions pay this."""
        buf = export.buffer
        key = (export.plan.digest, self.opts.bucket_bytes)
        if self._windows[0] != key:
            self._windows = (key, verify_windows(export.plan, self.opts.bucket_bytes))
        windows = self._windows[1]
        # one window of scratch, reused: no rank holds more than its shard + one bucket here either
        scratch = torch.empty(max((sum(r[3] for r in w) for w in windows), default=1), dtype=torch.uint8,
                              device=buf.device)
        hashers: dict[str, Any] = {}
        for win in windows:
            if self.rank != 0:
                mine = _coalesce([(s, n) for _, owner, s, n, _ in win if owner == self.rank])
                if len(mine) == 1:  # one run of the send buffer: sent as a view, no copy
                    await self.group.send(buf[mine[0][0]:mine[0][0] + mine[0][1]], 0)
                elif mine:
                    await self.group.send(_gather_runs(buf, mine, scratch), 0)
                continue
            regions: dict[int, tuple[int, int]] = {}
            off = 0
            for owner in sorted({r[1] for r in win}):
                runs = [(s, n) for _, o, s, n, _ in win if o == owner]
                size = sum(n for _, n in runs)
                if owner == 0:
                    _gather_runs(buf, runs, scratch[off:off + size])
                else:
                    await self.group.recv(scratch[off:off + size], owner)
                regions[owner] = (off, off + size)
                off += size
            host = scratch[:off].cpu().numpy()
            pos = {o: lo for o, (lo, _) in regions.items()}
            for _, owner, _, n, name in win:
                hashers.setdefault(name, xxhash.xxh64()).update(host[pos[owner]:pos[owner] + n].tobytes())
                pos[owner] += n
        want = {n: h.hexdigest() for n, h in hashers.items()}
        err = None
        if self.rank == 0:
            dead: list[str] = []
            got = await self._each("checksum", engines, self.link.checksums, dead)
            for name, sums in zip(engines, got, strict=True):
                bad = [k for k, v in want.items() if sums is not None and sums.get(k) != v]
                if bad:
                    err = f"checksum mismatch on engine {name!r} for {len(bad)} tensor(s), e.g. {bad[:3]}"
                    break
        outcome = await self.group.all_gather(err)
        errs = [e for e in outcome if e]
        if errs:
            raise SyncError(errs[0])
        return True

    async def catch_up(self, engine: str, version: int, export: ShardExport, sender: BulkSender) -> SyncReport:
        """Bring one (restarted or lagging) engine to `version`: every rank sends it its shard over
        `sender` (a collective). The engine joins this coordinator's set; the channel is rebuilt
        on the next push so it gets a receiver too."""
        sub = ShardedCoordinator(self.link, self.group, sender, [engine],
                                 ShardedOptions(self.opts.bucket_bytes, self.opts.pipeline_depth, "none", 0))
        try:
            rep = await sub.push(version, export)
        finally:
            await sub.close()
        adopt(self, engine, version, rep)
        return rep

    async def close(self) -> None:
        """Tear the channel down: the engines' receivers first (rank 0), then every rank's sender."""
        if self._open_for and self.rank == 0:
            try:
                await self._each("close channel", self._open_for, self.link.close, [])
            except SyncError as exc:
                log.warning("channel_close_failed", error=str(exc))
        self._open_for = None
        await self.group.all_gather(None)  # no sender goes before the engines let go of it
        await self.sender.close()
