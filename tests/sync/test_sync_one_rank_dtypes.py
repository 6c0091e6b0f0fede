"""One-rank pushes of flat exports of several dtypes and with 0-d tensors (weightsync/one_rank.py).

Each tensor of a one-rank transfer plan travels in its own dtype, so FP8 codes (as uint8)
beside fp32 block scales and bf16 weights go as byte ranges of one flat buffer, as do 0-d
tensors. Checked end to end: a real `GatheredSync` over zmq and broadcast (and ucx where its CPU extra is
importable) into FP8 torch engine processes, bit for bit; and 0-d tensors into in-process
engines that land through the real flat landing (the engine model has no 0-d weight).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from miles.core.errors import EngineError
from miles.core.schema.sync import SyncConfig
from miles.models.config import ModelSpec
from miles.models.fp8_layout import with_fp8
from miles.models.fp8_model import fp8_export
from miles.models.hf_io import hf_tensor_views, tensor_checksum
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.weightsync.actor_wire import WeightSync
from miles.weightsync.flat import FlatWeights
from miles.weightsync.one_rank import one_rank_export
from miles.weightsync.trainer_sync import GatheredSync

from .sync_helpers import client, held, perturb
from .test_sync_coordinator import MemLink

pytestmark = pytest.mark.timeout(120)
FP8_HOST = "tests/sync/procs/sync_fp8_engine_host.py"
CPU = torch.device("cpu")


def _mixed() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("codes", torch.randint(0, 255, (5, 3), generator=g, dtype=torch.uint8)),
            ("scale", torch.randn((), generator=g)),
            ("w", torch.randn(7, 2, generator=g).to(torch.bfloat16)),
            ("norm", torch.randn(7, generator=g))]


def test_several_dtypes_and_a_0d_tensor_make_a_one_rank_plan_of_the_flat_bytes() -> None:
    fw = FlatWeights.pack(_mixed(), CPU)
    assert fw.plan.dtypes == ("float32", "float32", "bfloat16", "uint8")  # widest first: no padding needed
    export = one_rank_export(fw)
    assert export is not None and export.buffer.data_ptr() == fw.buffer.data_ptr()
    assert export.plan.engines[0].plan == fw.plan  # the engines get the plan a gathered push sends
    buckets = export.plan.buckets(0, 0, 7)  # the flat plan's ranges: a tensor longer than a bucket is cut anywhere
    assert [r for b in buckets for r in b.ranges] == [[lo, hi] for lo, hi in fw.plan.ranges(7)]
    assert sum(b.nbytes for b in buckets) == fw.plan.nbytes
    assert dict(fw).keys() == dict(_mixed()).keys()
    assert all(torch.equal(dict(fw)[n], t) for n, t in _mixed())


def test_pack_refills_its_buffer_for_the_same_tensors_and_replans_for_others() -> None:
    first = FlatWeights.pack(_mixed(), CPU)
    again = FlatWeights.pack([(n, t + 1) for n, t in _mixed()], CPU, reuse=first)
    assert again is first and torch.equal(dict(again)["w"], _mixed()[2][1] + 1)
    fewer = FlatWeights.pack(_mixed()[:3], CPU, reuse=first)
    assert fewer is not first and fewer.plan.names == ("scale", "w", "codes")
    assert all(torch.equal(dict(fewer)[n], t) for n, t in _mixed()[:3])


def test_a_plan_with_an_empty_tensor_is_no_one_rank_plan() -> None:
    fw = FlatWeights.pack([("a", torch.ones(2)), ("empty", torch.ones(0, 3))], CPU)
    assert one_rank_export(fw) is None


async def test_0d_tensors_of_several_dtypes_go_one_rank_into_in_process_engines() -> None:
    """In-process engines (the real zmq sharded receiver and flat landing, test_sync_coordinator's
    MemLink) take only byte ranges: a tensor-by-tensor push would fail their `stage`."""
    link = MemLink()
    # no checksum verification: models/hf_io.py `tensor_checksum` cannot view a 0-d tensor as bytes
    sync = GatheredSync(link, SyncConfig(transport="zmq", bucket_mib=1, verify_every=0, step_timeout_s=10),
                        ["e0", "e1"])
    fw = FlatWeights.pack(_mixed(), CPU)
    try:
        for version in (1, 2):
            with torch.no_grad():
                fw.buffer.add_(version)
            rep = await sync.push(version, fw)
            assert rep.committed == ["e0", "e1"], rep
            assert rep.full_bytes == fw.plan.nbytes  # only the sharded coordinator counts full bytes
            for e in link.engines.values():
                assert torch.equal(e.live, fw.buffer)
        with pytest.raises(EngineError, match="byte ranges only"):  # what a gathered (tensor) push meets
            await link.stage("e0", 3, ["scale"], [torch.ones(())])
    finally:
        await sync.close()


def _fp8_spec(hidden: int) -> ModelSpec:
    cfg = tiny_config("qwen3", vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=1)
    return with_fp8(ModelSpec.from_hf(cfg), (128, 128))


def _fp8_payload(model: torch.nn.Module, spec: ModelSpec) -> list[tuple[str, torch.Tensor]]:
    """What the publisher's FP8 hook sends: codes (uint8), fp32 scales, the rest in bf16."""
    bf16 = ((n, t.to(torch.bfloat16)) for n, t in hf_tensor_views(model).items())  # type: ignore[arg-type]
    return [(n, t.clone()) for n, t in fp8_export(bf16, spec)]


@pytest.mark.parametrize("transport", ["zmq", "broadcast", *(["ucx"] if importlib.util.find_spec("ucxx") else [])])
async def test_fp8_codes_scales_and_bf16_go_one_rank_into_fp8_engines_bit_exact(procs, transport: str) -> None:
    spec = _fp8_spec(256)
    _, directory = procs.spawn([FP8_HOST, "--run-directory", "--name", "e0", "--hidden", "256"])
    procs.spawn([FP8_HOST, "--directory", directory, "--name", "e1", "--hidden", "256", "--seed", "1"])
    engines = ["e0", "e1"]
    host = await client(directory)
    model = build_model(spec, seed=100)
    cfg: Any = SyncConfig(transport=transport, bucket_mib=1, verify_every=1, step_timeout_s=20)  # type: ignore[arg-type]
    sync = WeightSync(host, cfg, engines)
    fw: FlatWeights | None = None
    try:
        for version in (1, 2):
            perturb(model, seed=version)
            sent = _fp8_payload(model, spec)
            assert {t.dtype for _, t in sent} == {torch.uint8, torch.float32, torch.bfloat16}
            fw = FlatWeights.pack(sent, CPU, reuse=fw)
            rep = await sync.push(version, fw)
            assert rep.committed == engines and rep.verified is True and rep.declined == [], rep
            assert rep.full_bytes == fw.plan.nbytes, rep  # the one-rank sharded push
            want = {n: tensor_checksum(t) for n, t in sent}
            assert await held(host, engines) == [want, want]
    finally:
        await sync.close()
        await host.stop()
