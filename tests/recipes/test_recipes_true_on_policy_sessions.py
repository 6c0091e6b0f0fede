"""True on-policy across turns: a session's second turn reuses the engine KV its first turn left
(engine session key), and the trainer's logprobs of that turn's tokens still equal the engine's
bit for bit. Dense and MoE (R3), fp32 and bf16, CPU. The same turns without the invariant mode
must differ, so the exact-0 check can fail; a turn that reused no KV would not test the reuse,
so the reuse is asserted too."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.core.schema.engine import EngineConfig
from miles.core.schema.trainer import TrainerConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.registry import build_model
from miles.trainer.deterministic import request_seed
from miles.trainer.fsdp import FSDPTrainer

from .rl_loop import prompts, sync, to_batch
from .test_recipes_true_on_policy import DENSE, MOE

pytestmark = pytest.mark.timeout(120)


async def _turn_two_diff(spec: ModelSpec, true_on_policy: bool, dtype: torch.dtype,
                         device: str = "cpu") -> tuple[float, int]:
    """Max |logp trainer - logp engine| over turn-two responses, and the KV tokens turn two reused."""
    cfg = TrainerConfig()
    cfg.device = device  # type: ignore[assignment]
    cfg.param_dtype = "bfloat16" if dtype == torch.bfloat16 else "float32"  # type: ignore[assignment]
    cfg.micro_batch_tokens = 64
    cfg.true_on_policy = true_on_policy
    cfg.correction.old_logprobs = "recompute"
    trainer = FSDPTrainer(cfg, spec, 0, 1, seed=5)
    engine = TorchEngine(build_model(spec, dtype=dtype, device=device, seed=9),
                         EngineConfig(max_batch_size=5, kv_budget_tokens=10_000, device=device),
                         batch_invariant=true_on_policy)

    def req(ids: list[int], session: str, seed: int) -> GenerateRequest:
        return GenerateRequest(input_ids=ids, session_key=session, return_routed_experts=spec.is_moe,
                               sampling=SamplingParams(temperature=1.0, max_new_tokens=6, seed=seed))

    try:
        await sync(trainer, engine, 0)
        ps = prompts(spec.vocab_size, 4, seed=0)
        sessions = [f"s{i}" for i in range(len(ps))]
        t1 = await asyncio.gather(*(engine.generate(req(p, s, request_seed(1, 0, i, 0)))
                                    for i, (p, s) in enumerate(zip(ps, sessions, strict=True))))
        # turn two: the whole of turn one (prompt and reply) plus a new user message of 3 tokens
        ps2 = [p + r.output_ids + [1, 2, 3] for p, r in zip(ps, t1, strict=True)]
        t2 = await asyncio.gather(*(engine.generate(req(p, s, request_seed(1, 1, i, 0)))
                                    for i, (p, s) in enumerate(zip(ps2, sessions, strict=True))))
        m = trainer.train_step(to_batch(ps2, list(t2), 1))
        return m["train/train_rollout_logprob_abs_diff_max"], sum(r.cached_tokens for r in t2)
    finally:
        await engine.close()
        trainer.close()


@pytest.mark.parametrize(("spec", "dtype"), [
    pytest.param(DENSE, torch.float32, id="dense-fp32"),
    pytest.param(DENSE, torch.bfloat16, id="dense-bf16"),
    pytest.param(MOE, torch.float32, id="moe-fp32"),
    pytest.param(MOE, torch.bfloat16, id="moe-bf16"),
])
async def test_a_turn_over_reused_session_kv_stays_bitwise_on_policy(spec: ModelSpec, dtype: torch.dtype) -> None:
    diff, reused = await _turn_two_diff(spec, True, dtype)
    assert reused > 0  # turn two ran over turn one's KV
    assert diff == 0.0
    diff_default, _ = await _turn_two_diff(spec, False, dtype)
    assert diff_default > 0.0  # the default (batched, packed) paths do differ: the check above can fail


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the invariant ops as Triton kernels)")
@pytest.mark.parametrize("spec", [DENSE, MOE], ids=["dense", "moe"])
async def test_reused_session_kv_stays_bitwise_on_policy_on_cuda(spec: ModelSpec) -> None:
    diff, reused = await _turn_two_diff(spec, True, torch.bfloat16, "cuda")
    assert reused > 0 and diff == 0.0
