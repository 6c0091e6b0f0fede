"""One-rank bf16 trainer memory (trainer/sharding.py): each FSDP2 unit's fp32 gradients exist
once during their reduce (`InPlaceSingleRankReduce`) and an untied model's embeddings are a unit
of their own, with the same numbers as FSDP2's own two-buffer reduce over one root unit, over
several accumulated micro-batches and steps."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import miles.trainer.sharding as sharding
from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.batch import TrainBatch
from miles.trainer.fsdp import FSDPTrainer
from miles.trainer.synthetic import engine_batch

pytestmark = pytest.mark.timeout(180)

SPEC = ModelSpec.from_hf(tiny_config("qwen2", vocab_size=512, hidden_size=64, num_hidden_layers=2))


def _trainer() -> FSDPTrainer:
    cfg = TrainerConfig()
    cfg.device = "cpu"
    cfg.param_dtype = "bfloat16"  # one rank computing in bf16: FSDP2-wrapped
    cfg.recompute = "full"
    cfg.micro_batch_tokens = 96  # several micro-batches a step: gradients accumulate
    cfg.correction.types = ["tis"]
    cfg.optim.lr = 1e-3
    return FSDPTrainer(cfg, SPEC, 0, 1, seed=0)


def _batch() -> TrainBatch:
    engine = build_model(SPEC, seed=0)  # scores the rollout logprobs the TIS correction reads
    return engine_batch(engine, groups=3, group_size=4, prompt_len=(8, 9), response_len=(24, 25), seed=0)


@pytest.fixture
def in_place(request: pytest.FixtureRequest) -> Iterator[bool]:
    before = sharding.SINGLE_RANK_REDUCE_IN_PLACE
    sharding.SINGLE_RANK_REDUCE_IN_PLACE = request.param
    yield request.param
    sharding.SINGLE_RANK_REDUCE_IN_PLACE = before


def test_the_memory_layout_gives_the_previous_numbers_exactly() -> None:
    got: dict[bool, tuple[dict[str, torch.Tensor], list[float]]] = {}
    before = sharding.SINGLE_RANK_REDUCE_IN_PLACE, sharding.EMBEDDINGS_OWN_UNIT
    try:
        for flag in (False, True):
            sharding.SINGLE_RANK_REDUCE_IN_PLACE = sharding.EMBEDDINGS_OWN_UNIT = flag
            t = _trainer()
            norms = [t.train_step(_batch())["train/grad_norm"] for _ in range(3)]
            params = {n: p.detach().to_local().clone()  # DTensor shards
                      for n, p in t.policy.named_parameters()}
            got[flag] = params, norms
    finally:
        sharding.SINGLE_RANK_REDUCE_IN_PLACE, sharding.EMBEDDINGS_OWN_UNIT = before
    (ref, ref_norms), (new, new_norms) = got[False], got[True]
    assert new_norms == ref_norms and all(n > 0 for n in new_norms)
    for name, p in ref.items():
        assert torch.equal(new[name], p), name
    assert any(not torch.equal(p, q) for p, q in zip(ref.values(), _trainer_params(), strict=True))


def _trainer_params() -> list[torch.Tensor]:
    return [p.detach().to_local().clone() for p in _trainer().policy.parameters()]


def _unit_buffers() -> list[tuple[str, int]]:
    """For each FSDP2 gradient reduce of a steady step (one per unit and micro-batch): the unit,
    and how many buffers of at least the unit's fp32 gradient size it allocated."""
    t = _trainer()
    batch = _batch()
    t.train_step(batch)  # step 1 (the optimizer's moments appear); the traced step is steady
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t.train_step(batch)
    out: list[tuple[str, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if not e.name.startswith("FSDP::post_backward_reduce"):
            continue
        unit = e.name.removeprefix("FSDP::post_backward_reduce").strip(" ()")  # "" = the root
        state = t.policy.get_submodule(unit)._get_fsdp_state()
        grad_bytes = 4 * sum(p.sharded_size.numel() for p in state._fsdp_param_group.fsdp_params)
        inner, sizes = list(e.children), []
        while inner:
            c = inner.pop()
            inner.extend(c.children)
            if type(c.extra_fields).__name__ == "_ExtraFields_Allocation" and c.extra_fields.alloc_size > 0:
                sizes.append(c.extra_fields.alloc_size)
        out.append((unit, sum(1 for n in sizes if n >= grad_bytes)))
    return out


@pytest.mark.parametrize("in_place", [True, False], indirect=True)
def test_each_reduce_holds_its_units_fp32_gradients_once(in_place: bool) -> None:
    calls = _unit_buffers()
    units = {u for u, _ in calls}
    # the root (head, final norm), the untied embeddings and the two blocks
    assert units == {"", "model.embed_tokens", "model.layers.0", "model.layers.1"}
    assert len(calls) >= 3 * len(units)  # 3 groups x 4 x 32 tokens over 96-token packs: every micro-batch reduces
    # in place the reduce input doubles as its output: one fp32 buffer of the unit's gradient
    # size per reduce, where FSDP2's own reduce allocates two (input and output)
    want = 1 if in_place else 2
    assert all(n == want for _, n in calls), calls


def test_in_place_comm_returns_the_input_and_refuses_the_unexpected() -> None:
    comm = sharding.InPlaceSingleRankReduce()
    kw = dict(dtype=torch.float32, device=torch.device("cpu"))
    inp = comm.allocate((6,), **kw)
    assert comm.allocate((6,), **kw) is inp  # the output: the same buffer
    fresh = comm.allocate((6,), **kw)  # the next unit's input: new memory
    assert fresh is not inp
    with pytest.raises(RuntimeError, match="differs from its input"):
        comm.allocate((4,), **kw)
    with pytest.raises(RuntimeError, match="reduce-scatter over one rank"):
        comm(inp, inp, None, None)
