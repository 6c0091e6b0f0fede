"""A gathered flat export pushed as a sharded sync with one rank (weightsync/one_rank.py).

The flat export is a one-rank sharded export as it stands: the same plan for the engines, its
own buffer as the send buffer. Pushed by `ShardedCoordinator` over a one-process `RankGroup`,
after the gathered coordinator pushed the version before it to the same engine processes, the
engines hold exactly the trainer's weights, checked by their checksums and by the sync's own
verification.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from miles.core.errors import SyncError
from miles.core.schema.sync import SyncConfig
from miles.models.hf_io import hf_tensor_views, tensor_checksum
from miles.transport.bulk.base import make_sender
from miles.weightsync.actor_wire import ActorSyncLink, WeightSync
from miles.weightsync.flat import FlatWeights
from miles.weightsync.one_rank import SoloRankGroup, one_rank_export
from miles.weightsync.param_buffer import pack_parameters
from miles.weightsync.shard_coordinator import ShardedCoordinator, ShardedOptions
from miles.weightsync.trainer_sync import goes_one_rank

from .sync_helpers import client, held, start_engines, trainer_model

pytestmark = pytest.mark.timeout(120)


def _flat_trainer() -> FlatWeights:
    model = trainer_model(hidden=256, layers=1)
    pack_parameters(list(model.parameters()))
    return FlatWeights.of(hf_tensor_views(model).items())


def test_the_flat_export_is_a_one_rank_export_of_the_same_bytes() -> None:
    fw = _flat_trainer()
    export = one_rank_export(fw)
    assert export is not None and export.rank == 0
    assert export.plan.engines[0].plan == fw.plan  # the engines get the plan a gathered push sends
    assert export.buffer.data_ptr() == fw.buffer.data_ptr() and export.buffer.numel() == fw.plan.nbytes
    buckets = export.plan.buckets(0, 0, 1 << 16)
    assert sum(b.nbytes for b in buckets) == fw.plan.nbytes
    assert all(b.contiguous_src() is not None for b in buckets)  # every bucket a view, no packing


def test_one_rank_buckets_are_the_flat_plans_ranges() -> None:
    """Cut at tensor boundaries, as the gathered coordinator cuts a flat export (a cut every bucket
    across tensors made the one-rank broadcast push slower: bench/results/weight_sync_one_rank_s19.txt)."""
    fw = _flat_trainer()
    export = one_rank_export(fw)
    assert export is not None
    for size in (1 << 16, 1 << 20, 3 << 20):
        got = [b.runs for b in export.plan.buckets(0, 0, size)]
        assert got == [((lo, lo, hi - lo),) for lo, hi in fw.plan.ranges(size)]
    with pytest.raises(SyncError, match="rank 0 and engine group 0 only"):
        export.plan.buckets(1, 0, 1 << 20)


def test_broadcast_goes_one_rank_from_a_cpu_trainer_only() -> None:
    assert all(goes_one_rank(t, torch.device("cpu")) for t in ("zmq", "ucx", "broadcast"))
    assert goes_one_rank("zmq", torch.device("cuda")) and not goes_one_rank("broadcast", torch.device("cuda"))
    assert not goes_one_rank("disk_delta", torch.device("cpu")) and not goes_one_rank("cuda_ipc", torch.device("cuda"))


async def test_the_solo_group_gathers_its_own_and_has_no_peers() -> None:
    g = SoloRankGroup()
    assert (g.rank, g.size) == (0, 1)
    assert await g.all_gather({"err": None}) == [{"err": None}]
    with pytest.raises(SyncError, match="no rank 1"):
        await g.send(torch.zeros(1), 1)


@pytest.mark.parametrize("transport", ["zmq", "broadcast", *(["ucx"] if importlib.util.find_spec("ucxx") else [])])
async def test_a_gathered_export_goes_through_the_sharded_coordinator_with_one_rank(procs, transport: str) -> None:
    directory = start_engines(procs, extra=["--hidden", "256", "--layers", "1"])
    host = await client(directory)
    fw = _flat_trainer()
    engines = ["e0", "e1"]

    def step(version: int) -> dict[str, str]:
        with torch.no_grad():  # change the flat buffer's bytes in place, as an optimizer step does
            for _, t in fw:
                t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(version)) * 0.01)
        return {n: tensor_checksum(t) for n, t in fw}

    cfg = SyncConfig(transport=transport, bucket_mib=1, verify_every=1, step_timeout_s=20)  # type: ignore[arg-type]
    gathered = WeightSync(host, cfg, engines)
    try:
        want = step(1)
        rep = await gathered.push(1, fw)
        assert rep.committed == engines and rep.verified is True, rep
        assert await held(host, engines) == [want, want]
    finally:
        await gathered.close()

    export = one_rank_export(fw)
    assert export is not None
    sender = make_sender(cfg, sharded=True)
    sharded = ShardedCoordinator(ActorSyncLink(host, cfg.step_timeout_s), SoloRankGroup(), sender, engines,
                                 ShardedOptions(1 << 20, verify_every=1))
    try:
        for version in (2, 3):
            want = step(version)
            rep = await sharded.push(version, export)
            assert rep.committed == engines and rep.dead == [] and rep.verified is True, rep
            assert rep.bytes == rep.full_bytes == fw.plan.nbytes, rep
            assert await held(host, engines) == [want, want]
    finally:
        await sharded.close()
        await host.stop()


async def test_a_flat_catch_up_goes_as_a_one_rank_push_and_the_engine_joins(procs) -> None:
    """`GatheredSync.catch_up` of a flat source: a one-rank sharded push over zmq (it counts the full
    bytes, as only the sharded coordinator does); the engine joins the set, and the next push over
    ucx or zmq reaches it too."""
    directory = start_engines(procs, extra=["--hidden", "256", "--layers", "1"])
    host = await client(directory)
    fw = _flat_trainer()
    transport = "ucx" if importlib.util.find_spec("ucxx") else "zmq"
    sync = WeightSync(host, SyncConfig(transport=transport, bucket_mib=1, verify_every=1, step_timeout_s=20),  # type: ignore[arg-type]
                      ["e0"])
    try:
        rep = await sync.push(1, fw)
        assert rep.committed == ["e0"] and rep.full_bytes == fw.plan.nbytes, rep
        up = await sync.catch_up("e1", 1, fw)
        assert up.committed == ["e1"] and up.transport == "zmq" and up.full_bytes == fw.plan.nbytes, up
        assert sync.engines == ["e0", "e1"] and sync.versions == {"e0": 1, "e1": 1}
        with torch.no_grad():
            fw.buffer.add_(1)
        want = {n: tensor_checksum(t) for n, t in fw}
        rep = await sync.push(2, fw)
        assert rep.committed == ["e0", "e1"] and rep.verified is True, rep
        assert await held(host, ["e0", "e1"]) == [want, want]
    finally:
        await sync.close()
        await host.stop()
