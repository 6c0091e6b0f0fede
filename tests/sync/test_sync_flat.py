"""Flat exports (weightsync/flat.py): plans, byte-range buckets, landing, and a real sync.

The multi-process tests push a trainer whose weights lie in one buffer to 2 engine
processes over zmq, broadcast (gloo) and ucx (TCP, when installed): once in the engines'
own order (each range lands straight in the staging slots) and once in reversed order
(ranges land piecewise), with bit-equal checksums after each version.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from miles.actors.messages import Health
from miles.core.errors import EngineError, SyncError
from miles.core.schema.sync import SyncConfig
from miles.models.hf_io import hf_tensor_views, tensor_checksum
from miles.transport.bulk.base import LocalWeights
from miles.weightsync.actor_wire import WeightSync
from miles.weightsync.flat import FlatLanding, FlatPlan, FlatWeights
from miles.weightsync.one_rank import one_rank_plan
from miles.weightsync.param_buffer import pack_parameters
from miles.weightsync.stager import WeightStager
from miles.weightsync.trainer_sync import ONE_RANK_TRANSPORTS

from .sync_helpers import client, held, perturb, start_engines, trainer_model

pytestmark = pytest.mark.timeout(90)


def _flat(sizes: list[int], dtype: torch.dtype = torch.float32) -> FlatWeights:
    buf = torch.arange(sum(sizes), dtype=dtype)
    views, pos = [], 0
    for i, n in enumerate(sizes):
        views.append((f"t{i}", buf[pos:pos + n]))
        pos += n
    return FlatWeights.of(views)


def test_ranges_cut_at_tensor_boundaries_and_split_large_tensors() -> None:
    fw = _flat([10, 20, 100, 5, 5, 30])  # fp32: 40, 80, 400, 20, 20, 120 bytes
    plan = fw.plan
    ranges = plan.ranges(128)
    assert ranges[0][0] == 0 and ranges[-1][1] == plan.nbytes
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))  # back to back, in order
    assert all(hi - lo <= 128 for lo, hi in ranges)
    cuts = {lo for lo, _ in ranges}
    inside_big = {c for c in cuts if 120 < c < 520}  # only the 400-byte tensor is cut inside
    assert cuts - inside_big <= set(plan.offsets)
    assert ranges[:2] == [(0, 120), (120, 248)]
    done = [n for lo, hi in ranges for n in plan.done_in(lo, hi)]
    assert done == list(plan.names)  # every tensor completes exactly once, in order


def test_plan_wire_round_trip_and_tampering() -> None:
    plan = _flat([3, 4]).plan
    assert FlatPlan.from_wire(plan.to_wire()) == plan
    bad = plan.to_wire()
    bad["shapes"][0] = [4]
    with pytest.raises(SyncError, match="does not end where the next one starts|digest"):
        FlatPlan.from_wire(bad)
    bad = plan.to_wire()
    bad["digest"] = "0" * 16
    with pytest.raises(SyncError, match="digest"):
        FlatPlan.from_wire(bad)
    with pytest.raises(SyncError, match="malformed flat plan"):
        FlatPlan.from_wire({"names": ["a"]})


def test_flat_weights_of_refuses_gaps_and_iterates_views() -> None:
    buf = torch.arange(10.0)
    with pytest.raises(SyncError, match="'b' does not follow"):
        FlatWeights.of([("a", buf[0:3]), ("b", buf[4:6])])
    with pytest.raises(SyncError, match="'b' does not follow"):
        FlatWeights.of([("a", buf[0:3]), ("b", torch.zeros(2))])
    fw = FlatWeights.of([("a", buf[0:4].view(2, 2)), ("b", buf[4:10])])
    got = dict(fw)
    assert got["a"].shape == (2, 2) and torch.equal(got["b"], buf[4:10])
    assert got["a"].data_ptr() == buf.data_ptr()  # views, not copies


def _local(slots: dict[str, torch.Tensor]) -> LocalWeights:
    def slot(name: str) -> torch.Tensor:
        if name not in slots:
            raise EngineError(f"unknown tensor {name!r}")
        return slots[name]
    return LocalWeights(0, lambda n: slots[n], slot)


@pytest.mark.parametrize("order", ["same", "reversed"])
def test_landing_fills_slots_region_or_piecewise(order: str) -> None:
    fw = _flat([10, 20, 100, 5, 5, 30])
    names = list(fw.plan.names)
    arena = torch.zeros(fw.plan.nbytes // 4)
    slots, pos = {}, 0
    for n in (names if order == "same" else names[::-1]):
        k = dict(fw)[n].numel()
        slots[n] = arena[pos:pos + k]
        pos += k
    landing = FlatLanding(fw.plan)
    local = _local(slots)
    assert (landing.region(local) is not None) == (order == "same")
    done = []
    for lo, hi in fw.plan.ranges(96):
        done += landing.land(lo, hi, fw.buffer[lo:hi], local)
    assert done == names
    for n, t in fw:
        assert torch.equal(slots[n], t), n


def test_landing_refuses_a_mismatched_engine() -> None:
    fw = _flat([4, 4])
    with pytest.raises(SyncError, match="'t1' has shape \\[4\\], this engine holds \\[5\\]"):
        FlatLanding(fw.plan).region(_local({"t0": torch.zeros(4), "t1": torch.zeros(5)}))
    with pytest.raises(SyncError, match="does not match this engine"):
        FlatLanding(fw.plan).region(_local({"t1": torch.zeros(4)}))
    landing = FlatLanding(fw.plan)
    with pytest.raises(SyncError, match="does not fit"):
        landing.land(0, 64, torch.zeros(64, dtype=torch.uint8), _local({"t0": torch.zeros(4), "t1": torch.zeros(4)}))


def test_stager_mark_staged_keeps_version_rules() -> None:
    st = WeightStager({"a": torch.zeros(2), "b": torch.zeros(2)})
    assert st.mark_staged(5, ["a"]) == 1
    with pytest.raises(EngineError, match="older version"):
        st.mark_staged(4, ["b"])
    assert st.mark_staged(6, ["a", "b"]) == 2  # a newer version drops the abandoned one
    st.check_complete(6)


def _flat_trainer(order: str) -> tuple[torch.nn.Module, FlatWeights]:
    """A trainer model whose HF weights lie in one buffer, in the engines' order or reversed."""
    model = trainer_model(hidden=512, layers=1)  # 2 MiB MLP weights: larger than a 1 MiB bucket
    if order == "same":
        pack_parameters(list(model.parameters()))
        return model, FlatWeights.of(hf_tensor_views(model).items())
    return model, FlatWeights.copy_of(list(hf_tensor_views(model).items())[::-1])


FLAT_TRANSPORTS = ["zmq", "broadcast", *(["ucx"] if importlib.util.find_spec("ucxx") else [])]


@pytest.mark.parametrize("transport", FLAT_TRANSPORTS)
@pytest.mark.parametrize("order", ["same", "reversed"])
async def test_flat_sync_reaches_bit_equality(procs, order: str, transport: str) -> None:
    """Ranges in the engines' order land straight in their slots (one copy or one receive);
    reversed, they land piecewise. Over zmq and ucx the flat export goes as a sharded sync with one
    rank (weightsync/one_rank.py). Then a tensor-by-tensor push on the same channel, and a flat one again."""
    directory = start_engines(procs, extra=["--hidden", "512", "--layers", "1"])
    host = await client(directory)
    model, fw = _flat_trainer(order)
    engines = ["e0", "e1"]
    sync = WeightSync(host, SyncConfig(transport=transport, bucket_mib=1, verify_every=1,  # type: ignore[arg-type]
                                       step_timeout_s=20), engines)
    try:
        for version in (1, 2):
            with torch.no_grad():  # change the flat buffer's bytes in place, as an optimizer step does
                for _, t in fw:
                    t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(version)) * 0.01)
            rep = await sync.push(version, fw)
            assert rep.committed == engines and rep.verified is True, rep
            assert rep.bytes == fw.plan.nbytes
            if transport in ONE_RANK_TRANSPORTS:  # a one-rank sharded push: its buckets, its full-bytes count
                transfer = one_rank_plan(fw.plan)
                assert transfer is not None
                assert rep.buckets == len(transfer.buckets(0, 0, 1 << 20)) and rep.full_bytes == fw.plan.nbytes
            else:
                assert rep.buckets == len(fw.plan.ranges(1 << 20)) and rep.full_bytes == 0
            want = {n: tensor_checksum(t) for n, t in fw}
            for got in await held(host, engines):
                assert got == want
            for e in engines:
                assert (await host.ref(e).ask(Health(), timeout=10)).version == version
        # The same engines then take a tensor-by-tensor push (a fresh model): the paths mix.
        perturb(model, seed=3)
        rep = await sync.push(3, hf_tensor_views(model).items())
        assert rep.committed == engines and rep.verified is True
        # and back to the flat export: each coordinator reopens the channel the other one replaced
        rep = await sync.push(4, fw)
        assert rep.committed == engines and rep.verified is True
        want = {n: tensor_checksum(t) for n, t in fw}
        assert await held(host, engines) == [want, want]
    finally:
        await sync.close()
        await host.stop()


async def test_flat_plan_that_does_not_match_the_engines_aborts_with_a_clear_error(procs) -> None:
    directory = start_engines(procs, n=1, extra=["--hidden", "512", "--layers", "1"])
    host = await client(directory)
    other = trainer_model(hidden=256, layers=1)  # another shape: the plan names the wrong sizes
    pack_parameters(list(other.parameters()))
    sync = WeightSync(host, SyncConfig(transport="zmq", bucket_mib=1, step_timeout_s=20), ["e0"])
    try:
        with pytest.raises(SyncError, match="flat plan failed on engine 'e0'.*this engine holds"):
            await sync.push(1, FlatWeights.of(hf_tensor_views(other).items()))
        assert (await host.ref("e0").ask(Health(), timeout=10)).version != 1
    finally:
        await sync.close()
        await host.stop()


def test_a_packed_trainer_lands_in_one_copy_on_a_swapping_engine() -> None:
    """The fast path's premise: a trainer packed in parameter order has the plan of the
    engine's staging buffers (both of them: they swap at every commit)."""
    from miles.models.hf_io import hf_param_views

    trainer, _ = _flat_trainer("same")
    engine = trainer_model(seed=5, hidden=512, layers=1)
    stager = WeightStager(hf_tensor_views(engine))
    assert stager.bind_model(engine, lambda n, t: hf_param_views(engine.spec, n, t))
    fw = FlatWeights.of(hf_tensor_views(trainer).items())
    landing = FlatLanding(fw.plan)
    for version in (1, 2):
        local = LocalWeights(0, lambda n: torch.zeros(0), stager.slot)
        assert landing.region(local) is not None
        for lo, hi in fw.plan.ranges(1 << 20):
            stager.mark_staged(version, landing.land(lo, hi, fw.buffer[lo:hi], local))
        stager.check_complete(version)
        stager.apply()
        assert all(torch.equal(hf_tensor_views(engine)[n], t) for n, t in fw)


async def test_a_plan_in_another_dtype_is_declined_and_tensors_go_instead(procs) -> None:
    """bf16 flat weights to fp32 engines: they decline the plan (bytes cannot land as another
    dtype) and the coordinator sends tensors, which the engines convert."""
    directory = start_engines(procs, extra=["--hidden", "512", "--layers", "1"])
    host = await client(directory)
    model = trainer_model(hidden=512, layers=1).to(torch.bfloat16)
    pack_parameters(list(model.parameters()))
    fw = FlatWeights.of(hf_tensor_views(model).items())
    engines = ["e0", "e1"]
    sync = WeightSync(host, SyncConfig(transport="zmq", bucket_mib=1, step_timeout_s=20), engines)
    try:
        rep = await sync.push(1, fw)
        assert rep.committed == engines
        want = {n: tensor_checksum(t.float()) for n, t in fw}
        assert await held(host, engines) == [want, want]
    finally:
        await sync.close()
        await host.stop()
