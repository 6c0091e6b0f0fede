"""The sharded coordinator (weightsync/shard_coordinator.py) on its own, without sockets or processes.

Four trainer ranks run as tasks of one loop, agreeing through an in-process RankGroup; the
two engines are in-process too: the real engine-side receiver (ShardReceiver, zmq channel:
the bytes ride with the call) lands each bucket through the real flat landing into a
staging buffer, and a commit installs the staging buffer only when every byte of it was
landed. The protocol's guarantees are checked directly: exact bytes, atomic versions, abort
everywhere on any rank's failure, a dead engine dropped, checksum verification.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import msgpack
import pytest
import torch

from miles.core.errors import ActorDeadError, EngineError, PlanMissing, SyncError
from miles.core.schema.sync import SyncConfig
from miles.models.config import ModelSpec
from miles.models.hf_io import tensor_checksum
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.transport.bulk.base import LocalWeights, SenderPlace, make_receiver
from miles.transport.bulk.zmq_channel import ZmqSender
from miles.weightsync.flat import FlatLanding, FlatPlan, FlatWeights
from miles.weightsync.flat_export import ShardExportBuffer
from miles.weightsync.shard_coordinator import ShardedCoordinator, ShardedOptions
from miles.weightsync.shard_plan import ShardExport, fsdp_rows

pytestmark = pytest.mark.timeout(60)
WORLD, ENGINES = 4, ["e0", "e1"]


class Hub:
    """What the ranks share: an all_gather round and point-to-point queues."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[Any] = [None] * size
        self.barrier = asyncio.Barrier(size)
        self.queues: dict[tuple[int, int], asyncio.Queue[torch.Tensor]] = {}

    def queue(self, src: int, dst: int) -> asyncio.Queue[torch.Tensor]:
        return self.queues.setdefault((src, dst), asyncio.Queue())


class LocalRankGroup:
    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank, self.size = hub, rank, hub.size

    async def all_gather(self, obj: Any) -> list[Any]:
        self.hub.slots[self.rank] = msgpack.packb(obj)  # what the real group carries: msgpack, never pickle
        await self.hub.barrier.wait()
        out = [msgpack.unpackb(s) for s in self.hub.slots]
        await self.hub.barrier.wait()
        return out

    async def send(self, t: torch.Tensor, dst: int) -> None:
        await self.hub.queue(self.rank, dst).put(t.clone())

    async def recv(self, t: torch.Tensor, src: int) -> None:
        t.copy_(await self.hub.queue(src, self.rank).get())


class MemEngine:
    """Live and staging bytes laid out by the flat plan; commit installs a complete staging buffer."""

    def __init__(self) -> None:
        self.plan: FlatPlan | None = None
        self.live = self.staging = torch.empty(0, dtype=torch.uint8)
        self.version, self.staged_version, self.staged_bytes = 0, -1, 0
        self.rx: Any = None

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        assert self.plan is not None
        return dict(FlatWeights(buf, self.plan))

    def local(self) -> LocalWeights:
        slots = self.views(self.staging)
        return LocalWeights(self.version, lambda n: self.views(self.live)[n], lambda n: slots[n])


class MemLink:
    """SyncLink over in-process engines; `fail[(engine, version)]` makes that engine's ranges
    raise (an ActorDeadError: it died)."""

    def __init__(self) -> None:
        self.engines = {n: MemEngine() for n in ENGINES}
        self.fail: dict[tuple[str, int], BaseException] = {}
        self.calls: list[str] = []

    async def pause(self, engine: str, mode: str) -> None:
        self.calls.append(f"pause {engine}")

    async def resume(self, engine: str) -> None:
        self.calls.append(f"resume {engine}")

    async def open(self, engine: str, tag: str, info: dict[str, Any], bucket_bytes: int) -> None:
        rx = make_receiver(tag, info, bucket_bytes)
        await rx.open()
        self.engines[engine].rx = rx

    async def plan(self, engine: str, plan: dict[str, Any]) -> bool | str:
        e = self.engines[engine]
        e.plan = FlatPlan.from_wire(plan)
        e.live, e.staging = torch.zeros(e.plan.nbytes, dtype=torch.uint8), torch.zeros(e.plan.nbytes, dtype=torch.uint8)
        e.landing = FlatLanding(e.plan)  # type: ignore[attr-defined]
        return True

    async def stage(self, engine: str, version: int, names: list[str], tensors: list[torch.Tensor]) -> int:
        raise EngineError("a sharded sync sends byte ranges only")

    async def recv(self, engine: str, version: int, header: dict[str, Any]) -> int:
        raise EngineError("a sharded sync sends byte ranges only")

    async def range(self, engine: str, version: int, digest: str, lo: int, hi: int, header: dict[str, Any],
                    data: torch.Tensor | None = None) -> int:
        exc = self.fail.get((engine, version))
        if exc is not None:
            raise exc
        e = self.engines[engine]
        if e.staged_version != version:
            e.staged_version, e.staged_bytes = version, 0
        header = msgpack.unpackb(msgpack.packb({k: v for k, v in header.items() if k != "data"})) | (
            {"data": header["data"].clone()} if "data" in header else {})  # what crosses the wire
        await e.rx.recv_flat(header, e.landing, e.local())  # type: ignore[attr-defined]
        e.staged_bytes += sum(b - a for a, b in header["ranges"])
        return e.staged_bytes

    async def commit(self, engine: str, version: int) -> None:
        e = self.engines[engine]
        if e.staged_version != version or e.staged_bytes != e.live.numel():
            raise EngineError(f"commit v{version}: {e.staged_bytes} of {e.live.numel()} bytes staged")
        e.live, e.staging = e.staging, e.live
        e.version, e.staged_version = version, -1

    async def abort(self, engine: str, version: int) -> None:
        self.calls.append(f"abort {engine} v{version}")
        self.engines[engine].staged_version = -1

    async def checksums(self, engine: str) -> dict[str, str]:
        e = self.engines[engine]
        return {n: tensor_checksum(t) for n, t in e.views(e.live).items()}

    async def close(self, engine: str) -> None:
        self.engines[engine].rx = None


def exports(seed: int) -> tuple[list[ShardExport], torch.Tensor]:
    """Every rank's sharded export of one model state, and the whole model's bytes."""
    spec = ModelSpec.from_hf(tiny_config("qwen3", vocab_size=96))
    model = build_model(spec, seed=seed)
    out = []
    for r in range(WORLD):
        params = [(n, p.data[slice(*fsdp_rows(p.shape[0], r, WORLD))], tuple(p.shape)) for n, p in model.named_parameters()]
        out.append(ShardExportBuffer().fill(spec, params, r, WORLD))
    from miles.models.hf_io import hf_tensor_views

    return out, FlatWeights.copy_of(hf_tensor_views(model).items()).buffer


async def push_all(coords: list[ShardedCoordinator], version: int, exs: list[ShardExport]) -> list[Any]:
    return await asyncio.gather(*(c.push(version, e) for c, e in zip(coords, exs, strict=True)),
                                return_exceptions=True)


def zmq_sender(rank: int, world: int) -> ZmqSender:
    """Trainer rank `rank`'s zmq sender (the one sender class both coordinators drive)."""
    return ZmqSender(SyncConfig(step_timeout_s=10.0), SenderPlace(rank, world))


def make(link: MemLink, verify_every: int = 1) -> list[ShardedCoordinator]:
    hub = Hub(WORLD)
    return [ShardedCoordinator(link, LocalRankGroup(hub, r), zmq_sender(r, WORLD), ENGINES,
                               ShardedOptions(4096, 2, "in_place", verify_every)) for r in range(WORLD)]


async def test_four_ranks_land_exact_versions_and_verify() -> None:
    link = MemLink()
    coords = make(link)
    for version, seed in ((1, 10), (2, 11)):
        exs, whole = exports(seed)
        reps = await push_all(coords, version, exs)
        for rep in reps:
            assert not isinstance(rep, BaseException), rep
            assert rep.committed == ENGINES and rep.verified is True and rep.bytes == whole.numel()
        for e in link.engines.values():
            assert e.version == version and torch.equal(e.live, whole)
    assert link.calls.count("pause e0") == 2 and link.calls.count("resume e0") == 2  # rank 0 alone drives them
    await asyncio.gather(*(c.close() for c in coords))


async def test_one_failing_bucket_aborts_the_version_on_every_rank() -> None:
    link = MemLink()
    coords = make(link, verify_every=0)
    exs1, whole1 = exports(10)
    assert all(not isinstance(r, BaseException) for r in await push_all(coords, 1, exs1))
    link.fail[("e1", 2)] = EngineError("disk full")
    loop = asyncio.get_running_loop()
    unretrieved: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx))
    try:
        reps = await push_all(coords, 2, exports(11)[0])
        await asyncio.sleep(0)
        gc.collect()  # a failed bucket left unconsumed would be reported here, when its future dies
    finally:
        loop.set_exception_handler(None)
    assert not unretrieved, [c.get("message") for c in unretrieved]
    assert all(isinstance(r, SyncError) and "disk full" in str(r) for r in reps), reps
    assert "abort e0 v2" in link.calls and "abort e1 v2" in link.calls
    for e in link.engines.values():  # nothing half-installed: both still serve v1
        assert e.version == 1 and torch.equal(e.live, whole1)
    del link.fail[("e1", 2)]
    exs3, whole3 = exports(12)
    reps = await push_all(coords, 3, exs3)  # the next version goes through (the channel is reopened)
    assert all(not isinstance(r, BaseException) and r.committed == ENGINES for r in reps), reps
    assert all(torch.equal(e.live, whole3) for e in link.engines.values())


async def test_a_dead_engine_is_dropped_and_reported_by_every_rank() -> None:
    link = MemLink()
    coords = make(link, verify_every=0)
    link.fail[("e1", 1)] = ActorDeadError("e1 is gone")
    exs, whole = exports(10)
    reps = await push_all(coords, 1, exs)
    for rep in reps:
        assert not isinstance(rep, BaseException), rep
        assert rep.committed == ["e0"] and rep.dead == ["e1"]
    assert torch.equal(link.engines["e0"].live, whole) and link.engines["e1"].version == 0


async def test_an_engine_that_lost_the_plan_is_left_out_like_a_dead_one() -> None:
    """An engine restarted between two pushes answers PlanMissing (no flat plan held): the version
    commits on the others, the engine is reported with the dead, and the next push resends the plan."""
    link = MemLink()
    coords = make(link, verify_every=0)
    link.fail[("e1", 1)] = PlanMissing("e1 holds plan None")
    exs, whole = exports(10)
    reps = await push_all(coords, 1, exs)
    for rep in reps:
        assert not isinstance(rep, BaseException), rep
        assert rep.committed == ["e0"] and rep.dead == ["e1"]
    exs2, whole2 = exports(11)
    reps = await push_all(coords, 2, exs2)
    assert all(not isinstance(r, BaseException) and r.committed == ENGINES for r in reps), reps
    assert all(torch.equal(e.live, whole2) for e in link.engines.values())


def exports_of(model: torch.nn.Module, bufs: list[ShardExportBuffer]) -> tuple[list[ShardExport], torch.Tensor]:
    from miles.models.hf_io import hf_tensor_views

    out = []
    for r, buf in enumerate(bufs):
        params = [(n, p.data[slice(*fsdp_rows(p.shape[0], r, WORLD))], tuple(p.shape)) for n, p in model.named_parameters()]
        out.append(buf.fill(model.spec, params, r, WORLD))
    return out, FlatWeights.copy_of(hf_tensor_views(model).items()).buffer


async def test_delta_sends_only_changed_words_and_falls_back_to_full() -> None:
    link = MemLink()
    hub = Hub(WORLD)
    coords = [ShardedCoordinator(link, LocalRankGroup(hub, r), zmq_sender(r, WORLD), ENGINES,
                                 ShardedOptions(4096, 2, "none", 1, delta=True)) for r in range(WORLD)]
    model = build_model(ModelSpec.from_hf(tiny_config("qwen3", vocab_size=96)), seed=10).requires_grad_(False)
    bufs = [ShardExportBuffer() for _ in range(WORLD)]
    params = list(model.parameters())
    g = torch.Generator().manual_seed(0)
    sent = []
    for version in (1, 2, 3):
        if version == 2:  # a sparse update: ~1 % of the elements change
            for p in params:
                mask = torch.rand(p.shape, generator=g) < 0.01
                p.add_(mask * 0.01)
        if version == 3:  # a dense one: every element changes, deltas would be larger
            for p in params:
                p.mul_(1.001)
        exs, whole = exports_of(model, bufs)
        reps = await push_all(coords, version, exs)
        assert all(not isinstance(r, BaseException) for r in reps), reps
        assert all(r.verified is True for r in reps)  # the engines' checksums match the trainer's
        for e in link.engines.values():
            assert torch.equal(e.live, whole)
        sent.append((sum(r.bytes for r in reps), sum(r.full_bytes for r in reps)))
    (b1, f1), (b2, f2), (b3, f3) = sent
    assert b1 == f1  # no base yet: in full
    assert b2 < f2 * 0.1  # ~1 % changed: (index + word) per change, far under the full bytes
    assert b3 == f3  # everything changed: the full path
    # an engine that lost its base (restarted) gets the full bytes again
    link.engines["e1"].version = 0
    for c in coords:
        c.versions["e1"] = 0
    for p in params:
        p[..., :1].add_(0.5)
    exs, whole = exports_of(model, bufs)
    reps = await push_all(coords, 4, exs)
    assert all(not isinstance(r, BaseException) and r.bytes == r.full_bytes for r in reps), reps
    assert all(torch.equal(e.live, whole) for e in link.engines.values())


async def test_a_restarted_engine_is_reconnected_and_sent_the_whole_version() -> None:
    """Rank 0 alone learns of the restart (its engine watcher): the next push reopens the channel,
    resends the plan and goes in full, every rank following rank 0's decision."""
    link = MemLink()
    hub = Hub(WORLD)
    coords = [ShardedCoordinator(link, LocalRankGroup(hub, r), zmq_sender(r, WORLD), ENGINES,
                                 ShardedOptions(4096, 2, "none", 0, delta=True)) for r in range(WORLD)]
    model = build_model(ModelSpec.from_hf(tiny_config("qwen3", vocab_size=96)), seed=10).requires_grad_(False)
    bufs = [ShardExportBuffer() for _ in range(WORLD)]
    for version in (1, 2):
        with torch.no_grad():
            next(model.parameters())[version].add_(1.0)
        exs, whole = exports_of(model, bufs)
        reps = await push_all(coords, version, exs)
        assert all(not isinstance(r, BaseException) for r in reps), reps
    assert reps[0].bytes < reps[0].full_bytes  # v2 went as a delta
    link.engines["e1"] = MemEngine()  # e1 restarted: no receiver, no plan, initial weights
    coords[0].forget_engine("e1")
    with torch.no_grad():
        next(model.parameters())[3].add_(1.0)
    exs, whole = exports_of(model, bufs)
    reps = await push_all(coords, 3, exs)
    assert all(not isinstance(r, BaseException) and r.bytes == r.full_bytes for r in reps), reps
    assert all(e.version == 3 and torch.equal(e.live, whole) for e in link.engines.values())
