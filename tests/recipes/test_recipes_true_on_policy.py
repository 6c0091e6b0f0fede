"""True on-policy: engine and trainer logprobs are bitwise equal over a real rollout.

Dense and MoE (R3 routing replay), fp32 and bf16 on the CPU; bf16 on CUDA when present
(the H200 check). The same runs in the default (batched, packed) mode must differ, so
each exact-0 check can fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.core.schema.engine import EngineConfig
from miles.core.schema.trainer import TrainerConfig
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.invariant import BatchInvariant, invariant_active, tiled_linear
from miles.models.moe import Experts
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.fsdp import FSDPTrainer

from .rl_loop import prompts, rollout, sync, to_batch

DENSE = ModelSpec.from_hf(
    tiny_config("qwen3", vocab_size=64, num_hidden_layers=2, initializer_range=0.1)
)
# Sized so that the default expert dispatch switches path with the token count (dense for a
# decode step, grouped for a prefill or a training sequence): the invariant one must not.
MOE = ModelSpec.from_hf(
    tiny_config(
        "qwen3_moe",
        vocab_size=64,
        num_hidden_layers=2,
        initializer_range=0.1,
        num_experts=16,
        moe_intermediate_size=128,
    )
)


async def _max_diff(
    spec: ModelSpec, true_on_policy: bool, dtype: torch.dtype, device: str = "cpu"
) -> float:
    cfg = TrainerConfig()
    cfg.device = device  # type: ignore[assignment]
    cfg.param_dtype = "bfloat16" if dtype == torch.bfloat16 else "float32"  # type: ignore[assignment]
    cfg.micro_batch_tokens = 64
    cfg.optim.lr = 1e-2
    cfg.true_on_policy = true_on_policy
    cfg.correction.old_logprobs = "recompute"
    trainer = FSDPTrainer(cfg, spec, 0, 1, seed=5)
    # the engine holds bf16 weights (the sync casts the trainer's fp32 masters into them)
    engine = TorchEngine(
        build_model(spec, dtype=dtype, device=device, seed=9),
        EngineConfig(max_batch_size=5, device=device),
        batch_invariant=true_on_policy,
    )
    worst = 0.0
    try:
        await sync(trainer, engine, 0)
        for step in range(2):  # the second rollout runs on trained, synced weights
            # prompts of different lengths decode together, rows join and leave the batch
            ps = prompts(spec.vocab_size, 4, seed=step)
            res = await rollout(
                engine, ps, 2, run_seed=1, step=step, max_new=8, routes=spec.is_moe
            )
            m = trainer.train_step(to_batch(ps, res, 2))
            worst = max(worst, m["train/train_rollout_logprob_abs_diff_max"])
            if spec.is_moe and true_on_policy:  # the live router agrees with the recorded one
                assert m["train/routing_overlap"] == 1.0
            await sync(trainer, engine, step + 1)
    finally:
        await engine.close()
        trainer.close()
    return worst


CASES = [
    pytest.param(DENSE, torch.float32, id="dense-fp32"),
    pytest.param(DENSE, torch.bfloat16, id="dense-bf16"),
    pytest.param(MOE, torch.float32, id="moe-fp32"),
    pytest.param(MOE, torch.bfloat16, id="moe-bf16"),
]


@pytest.mark.parametrize(("spec", "dtype"), CASES)
async def test_engine_and_trainer_logprobs_are_bitwise_equal(
    spec: ModelSpec, dtype: torch.dtype
) -> None:
    assert await _max_diff(spec, True, dtype) == 0.0
    # the default (batched, packed) paths do differ: the check above can fail
    assert await _max_diff(spec, False, dtype) > 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the H200 bf16 check)")
@pytest.mark.parametrize("spec", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
async def test_bitwise_equal_on_cuda(spec: ModelSpec, dtype: torch.dtype) -> None:
    # on CUDA the invariant ops are Triton kernels and the trainer runs one packed forward
    assert await _max_diff(spec, True, dtype, "cuda") == 0.0


def test_rotary_frequencies_stay_fp32_when_the_model_is_cast() -> None:
    fp32 = build_model(DENSE, seed=0)
    bf16 = build_model(DENSE, dtype=torch.bfloat16, seed=0)
    assert bf16.model.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(bf16.model.rotary.inv_freq, fp32.model.rotary.inv_freq)
    pos = torch.arange(9)[None]
    for a, b in zip(bf16.model.rotary(pos, torch.bfloat16), fp32.model.rotary(pos, torch.bfloat16), strict=True):
        assert torch.equal(a, b)


def test_invariant_experts_do_not_depend_on_the_token_count() -> None:
    g = torch.Generator().manual_seed(0)
    ex = Experts(16, 64, 128)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) * 0.1)
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) * 0.1)
    x = torch.randn(40, 64, generator=g)
    ids = torch.stack([torch.randperm(16, generator=g)[:2] for _ in range(40)])
    w = torch.rand(40, 2, generator=g)
    assert not invariant_active()
    with BatchInvariant():
        assert invariant_active()
        full = ex(x, ids, w)
        parts = [ex(x[s : s + n], ids[s : s + n], w[s : s + n]) for s, n in ((0, 1), (3, 5), (8, 32))]
    assert not invariant_active()
    for (s, n), p in zip(((0, 1), (3, 5), (8, 32)), parts, strict=True):
        assert torch.equal(p, full[s : s + n])
    torch.testing.assert_close(full, ex(x, ids, w), rtol=1e-5, atol=1e-6)  # same function


def test_tiled_linear_is_batch_invariant() -> None:
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 64, generator=g), torch.randn(37, 64, generator=g)
    full = tiled_linear(x, w, None, 16)
    for s, n in ((0, 1), (5, 3), (16, 17), (30, 7)):
        assert torch.equal(tiled_linear(x[s : s + n], w, None, 16), full[s : s + n])
    with BatchInvariant():
        y = torch.nn.functional.linear(x, w)
    assert torch.equal(y, full)
    assert np.isfinite(y.numpy()).all()
