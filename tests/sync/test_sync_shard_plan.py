"""The sharded-sync transfer plan (weightsync/shard_plan.py) and the per-rank export
(weightsync/flat_export.py ShardExportBuffer), without processes: the ranks' send buffers,
landed where the plan says, rebuild every engine's bytes exactly."""

from __future__ import annotations

import pytest
import torch

from miles.core.errors import SyncError
from miles.models.config import ModelSpec
from miles.models.hf_io import hf_tensor_views
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.weightsync.flat import FlatWeights
from miles.weightsync.flat_export import ShardExportBuffer, hf_parts
from miles.weightsync.shard_plan import EngineLayout, TrainerLayout, TransferPlan, fsdp_rows

pytestmark = pytest.mark.timeout(60)


def _exports(arch: str, world: int, dtype: torch.dtype) -> tuple[list, FlatWeights]:
    spec = ModelSpec.from_hf(tiny_config(arch, vocab_size=96))
    model = build_model(spec, seed=3)
    exports = []
    for r in range(world):  # each rank sees only its FSDP2 dim-0 shard of each parameter
        params = []
        for n, p in model.named_parameters():
            a, b = fsdp_rows(p.shape[0], r, world)
            params.append((n, p.data[a:b], tuple(p.shape)))
        exports.append(ShardExportBuffer().fill(spec, params, r, world, dtype))
    whole = FlatWeights.copy_of(hf_tensor_views(model).items(), dtype)
    return exports, whole


@pytest.mark.parametrize(("arch", "world", "dtype"), [("qwen3", 4, torch.float32), ("qwen3_moe", 4, torch.bfloat16),
                                                      ("qwen3_moe", 3, torch.float32)])
def test_rank_slices_land_into_the_whole_model(arch: str, world: int, dtype: torch.dtype) -> None:
    exports, whole = _exports(arch, world, dtype)
    plan = exports[0].plan
    assert plan.engines[0].plan.names == whole.plan.names and plan.engines[0].plan.nbytes == whole.plan.nbytes
    assert sum(plan.send_bytes) == whole.plan.nbytes  # every byte sent once, by its owner
    landed = torch.zeros(whole.plan.nbytes, dtype=torch.uint8)
    for ex in exports:
        assert ex.buffer.numel() == plan.send_bytes[ex.rank]
        buckets = ex.plan.buckets(ex.rank, 0, 1000)
        assert all(b.nbytes <= 1000 for b in buckets)
        assert all(b.contiguous_src() is not None for b in buckets)  # whole-model engines: no pack copy
        for b in buckets:
            for s, d, n in b.runs:
                landed[d:d + n] = ex.buffer[s:s + n]
    assert torch.equal(landed, whole.buffer)


def test_engine_tp_rows_split_two_ways() -> None:
    """A dim-0 engine TP split: two groups, each holding half the rows of every tensor."""
    spec = ModelSpec.from_hf(tiny_config("qwen3", vocab_size=96))
    model = build_model(spec, seed=3)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    layout = TrainerLayout.fsdp([(n, s, hf_parts(spec, n, s)) for n, s in shapes.items()], 4, "float32")
    tensors = layout.hf_tensors()
    groups = [EngineLayout.split(tensors, "float32", {n: fsdp_rows(s[0], g, 2) for n, s in tensors})
              for g in range(2)]
    plan = TransferPlan(layout, groups)
    views = hf_tensor_views(model)
    for g, eng in enumerate(groups):
        want = FlatWeights.copy_of([(n, views[n][slice(*eng.rows[n])]) for n, _ in tensors], torch.float32)
        got = torch.zeros_like(want.buffer)
        for r in range(4):
            params = {n: p.data[slice(*fsdp_rows(p.shape[0], r, 4))] for n, p in model.named_parameters()}
            for p in plan.pieces[r]:
                if p.group != g:
                    continue
                t = params[p.param]
                a = fsdp_rows(shapes[p.param][0], r, 4)[0]
                src = t[p.expert - a][slice(*p.param_rows)] if p.expert is not None else \
                    t[p.param_rows[0] - a:p.param_rows[1] - a]
                got[p.dst:p.dst + p.nbytes] = src.contiguous().view(-1).view(torch.uint8)
        assert torch.equal(got, want.buffer)


def test_plan_refuses_layouts_that_do_not_meet() -> None:
    spec = ModelSpec.from_hf(tiny_config("qwen3", vocab_size=96))
    shapes = {n: tuple(p.shape) for n, p in build_model(spec, seed=3).named_parameters()}
    layout = TrainerLayout.fsdp([(n, s, hf_parts(spec, n, s)) for n, s in shapes.items()], 2, "float32")
    with pytest.raises(SyncError, match="lands"):
        TransferPlan(layout, [EngineLayout.whole(layout.hf_tensors(), "bfloat16")])
    with pytest.raises(SyncError, match="no trainer parameter"):
        TransferPlan(layout, [EngineLayout.whole([*layout.hf_tensors(), ("extra.weight", (4, 4))], "float32")])
