"""The broadcast channel refuses two members on one GPU instead of hanging in NCCL, and never waits
for ever on a member that does not take part.

CI has no GPU, so the groups here are gloo groups on loopback (threads of this process, each with
its own store client, as separate members would be); the device each member claims is given to the
same function the NCCL path calls with the member's real GPU (`_make_pg(..., device=...)`).
"""

from __future__ import annotations

import asyncio
import datetime
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from miles.core.config import load_config
from miles.core.errors import ConfigError, SyncError
from miles.core.schema import MilesConfig
from miles.core.schema.sync import SyncConfig
from miles.launch.sync_checks import broadcast_placement_errors
from miles.launch.validate import validate_launch
from miles.transport.bulk.broadcast import (
    BroadcastReceiver,
    BroadcastSender,
    _broadcast_all,
    _make_pg,
    _shutdown,
)
from miles.transport.bulk.nccl_devices import MemberDevice, check_one_gpu_each, shared_devices
from miles.weightsync.actor_wire import WeightSync
from miles.weightsync.flat import FlatWeights

from .sync_helpers import client, start_engines, trainer_model

pytestmark = pytest.mark.timeout(60)
QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.toml"
GPU_A, GPU_B, GPU_C = (f"GPU-{c * 8}-0000-0000-0000-{c * 12}" for c in "abc")


def _member(rank: int, who: str, uuid: str, index: int = 0) -> MemberDevice:
    return MemberDevice(rank, who, "node1", index, uuid)


def test_members_sharing_a_gpu_are_named_with_the_gpu_and_the_fix() -> None:
    apart = [_member(0, "trainer rank 0", GPU_A), _member(1, "engine 'e0'", GPU_B, 1),
             _member(2, "engine 'e1'", GPU_C, 2)]
    assert shared_devices(apart) == []
    check_one_gpu_each(apart)

    # an index means nothing across processes (CUDA_VISIBLE_DEVICES): only the UUID says "one GPU"
    same_index = [_member(0, "trainer rank 0", GPU_A, 0), _member(1, "engine 'e0'", GPU_B, 0)]
    check_one_gpu_each(same_index)

    together = [_member(2, "engine 'e1'", GPU_A), _member(0, "trainer rank 0", GPU_A), _member(1, "engine 'e0'", GPU_B)]
    assert [[m.rank for m in g] for g in shared_devices(together)] == [[0, 2]]
    with pytest.raises(SyncError) as err:
        check_one_gpu_each(together)
    msg = str(err.value)
    assert "trainer rank 0 (group rank 0, node1 cuda:0) and engine 'e1' (group rank 2, node1 cuda:0)" in msg
    assert GPU_A in msg and GPU_B not in msg
    assert "one GPU per member" in msg and "cuda_ipc" in msg and "zmq" in msg


def test_a_member_device_travels_as_json_and_a_malformed_one_is_named() -> None:
    m = _member(3, "engine 'engine-1'", GPU_B, 1)
    assert MemberDevice.from_wire(m.to_wire().encode()) == m
    with pytest.raises(SyncError, match="malformed device"):
        MemberDevice.from_wire(b'{"rank": 1}')


def _join_all(claims: list[MemberDevice | None], timeout_s: float, join: list[int] | None = None) -> list[Any]:
    """Each rank of `claims` makes its gloo group member in a thread of its own, claiming its device,
    as the NCCL path has every member claim its GPU; returns each rank's group or its error. Ranks
    outside `join` never come."""
    world = len(claims)
    timeout = datetime.timedelta(seconds=timeout_s)
    server = TCPStore("127.0.0.1", 0, world, True, timeout=timeout, wait_for_workers=False)

    def member(rank: int) -> Any:
        store = server if rank == 0 else TCPStore("127.0.0.1", server.port, world, False, timeout=timeout,
                                                  wait_for_workers=False)
        try:
            return _make_pg("gloo", store, rank, world, timeout, claims[rank])
        except Exception as exc:  # noqa: BLE001 - each member's outcome is what the test reads
            return exc

    ranks = list(range(world)) if join is None else join
    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(member, ranks))


def test_every_member_refuses_a_group_with_two_members_on_one_gpu() -> None:
    claims = [_member(0, "trainer rank 0", GPU_A), _member(1, "engine 'e0'", GPU_B, 1),
              _member(2, "engine 'e1'", GPU_B, 1)]
    out = _join_all(claims, timeout_s=20)
    for rank, got in enumerate(out):
        assert isinstance(got, SyncError), (rank, got)
        assert "engine 'e0' (group rank 1, node1 cuda:1) and engine 'e1' (group rank 2, node1 cuda:1)" in str(got)
        assert f"share one GPU ({GPU_B})" in str(got)


def test_members_on_their_own_gpus_make_a_working_group() -> None:
    claims = [_member(0, "trainer rank 0", GPU_A), _member(1, "engine 'e0'", GPU_B, 1)]
    pgs = _join_all(claims, timeout_s=20)
    assert not [p for p in pgs if isinstance(p, BaseException)], pgs
    sent, got = torch.arange(16, dtype=torch.float32), torch.zeros(16)

    async def both() -> None:
        await asyncio.gather(_broadcast_all(pgs[0], [sent], 20.0), _broadcast_all(pgs[1], [got], 20.0))

    asyncio.run(both())
    assert torch.equal(got, sent)
    for pg in pgs:
        _shutdown(pg)


def test_a_member_that_never_joins_is_named_by_the_others() -> None:
    claims = [_member(0, "trainer rank 0", GPU_A), _member(1, "engine 'e0'", GPU_B), _member(2, "engine 'e1'", GPU_C)]
    out = _join_all(claims, timeout_s=1.0, join=[0, 1])
    for got in out:
        assert isinstance(got, SyncError) and "group ranks [2] never joined" in str(got), got


def test_a_member_that_never_issues_its_broadcast_ends_the_wait_with_a_sync_error() -> None:
    """A simulation of an NCCL group, whose kernels wait for a missing member for ever: the gloo
    group's own timeout is set far beyond the wait's bound, so only the bound can end the wait."""
    pgs = _join_all([None, None], timeout_s=30.0)
    assert not [p for p in pgs if isinstance(p, BaseException)], pgs

    async def alone() -> None:
        await _broadcast_all(pgs[0], [torch.ones(8)], 0.5, "broadcast of v7 (32 bytes)")

    try:
        with pytest.raises(SyncError) as err:
            asyncio.run(alone())
    finally:
        for pg in pgs:
            _shutdown(pg)
    assert "broadcast of v7 (32 bytes) did not complete within 0.5s" in str(err.value)
    assert "never took part" in str(err.value)


async def test_a_push_to_an_engine_that_never_receives_fails_naming_the_version() -> None:
    """The real sender and receivers (gloo on CPU): one of two engines joins but never receives."""
    tx = BroadcastSender(SyncConfig(transport="broadcast", step_timeout_s=2.0))
    infos = await tx.open(["e0", "e1"])
    assert [i["member"] for i in infos] == ["e0", "e1"]
    rxs = [BroadcastReceiver(info, 1 << 10) for info in infos]
    await asyncio.gather(tx.connected(), *(rx.open() for rx in rxs))
    try:
        weights = FlatWeights.of([("w", torch.arange(64, dtype=torch.float32))])
        tx.prepare_flat(7, 0, 0, 256, weights)
        got = torch.empty(256, dtype=torch.uint8)
        pending = asyncio.ensure_future(_broadcast_all(rxs[0]._pg, [got], 2.0))  # e0 takes part, e1 never does
        with pytest.raises(SyncError, match=r"broadcast of v7 \(256 bytes\)"):
            await tx.transmit()
        await asyncio.gather(pending, return_exceptions=True)
    finally:
        await asyncio.gather(tx.close(), *(rx.close() for rx in rxs))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for the trainer and the engines")
async def test_a_trainer_and_engines_on_one_gpu_are_refused_instead_of_hanging(procs) -> None:
    """The real NCCL path: the trainer here and two engines on the same GPU (what hung on an H100)."""
    from miles.models.hf_io import hf_tensor_views

    directory = start_engines(procs, extra=["--device", "cuda"])  # every process's cuda:0: one GPU
    host = await client(directory)
    model = trainer_model().to("cuda")
    sync = WeightSync(host, SyncConfig(transport="broadcast", bucket_mib=1, step_timeout_s=30), ["e0", "e1"],
                      device="cuda")
    try:
        with pytest.raises(SyncError, match=r"share one GPU \(") as err:
            await sync.push(1, hf_tensor_views(model).items())
        assert "cuda_ipc" in str(err.value), err.value
    finally:
        await sync.close()
        await host.stop()


def _cfg(*sets: str) -> MilesConfig:
    return load_config(MilesConfig, str(QUICKSTART), ["sync.transport=broadcast", *sets])


@pytest.mark.parametrize(("sets", "who"), [
    (["engine.device=cuda", "trainer.device=cuda"], "trainer rank 0, engine 0 on one GPU (cuda:0"),
    (["engine.device=cuda", "trainer.device=auto"], "trainer rank 0, engine 0 on one GPU (cuda:0"),
    (["engine.device=cuda:1", "trainer.device=cuda", "engine.num_engines=2"], "engine 0, engine 1 on one GPU (cuda:1"),
    (["engine.device=cuda:1", "trainer.device=cuda", "trainer.world_size=2", "sync.sharded=true"],
     "trainer rank 1, engine 0 on one GPU (cuda:1"),
])
def test_a_local_launch_that_puts_two_members_on_one_gpu_is_refused(sets: list[str], who: str) -> None:
    errs = broadcast_placement_errors(_cfg(*sets))
    assert len(errs) == 1 and who in errs[0], errs
    assert "sync.transport = 'cuda_ipc' or 'zmq'" in errs[0]


@pytest.mark.parametrize("sets", [
    ["engine.device=cuda:1", "trainer.device=cuda"],  # the trainer on cuda:0, the engine on cuda:1
    ["engine.device=cuda:1", "trainer.device=cuda", "trainer.world_size=2"],  # gathered: rank 0 alone sends
    ["engine.device=cuda", "trainer.device=cpu", "engine.num_engines=2"],  # gloo
    ["engine.device=cpu", "trainer.device=auto", "engine.num_engines=2"],  # auto: CUDA not known here
    ["engine.device=cuda", "trainer.device=cuda", "sync.transport=cuda_ipc", "engine.num_engines=2"],
])
def test_a_local_launch_with_one_gpu_per_member_or_no_nccl_passes(sets: list[str]) -> None:
    assert broadcast_placement_errors(_cfg(*sets)) == []


def test_the_refusal_comes_from_the_local_launch_check_and_not_under_slurm() -> None:
    cfg = _cfg("engine.device=cuda", "trainer.device=cuda")
    with pytest.raises(ConfigError, match="NCCL cannot place two ranks of one group on one GPU"):
        validate_launch(cfg)
    validate_launch(cfg, local=False)  # a Slurm step may have a GPU of its own: the group checks then
