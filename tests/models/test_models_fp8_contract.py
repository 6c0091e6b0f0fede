"""The FP8 contract end to end on the CPU: an FSDP trainer whose forward fake-quantizes its
master weights, an engine on FP8 codes fed by FP8 syncs, true on-policy: the logprob
difference the trainer's metrics report stays exactly 0 (and is not 0 without the contract)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from miles.core.schema.engine import EngineConfig
from miles.core.schema.trainer import TrainerConfig
from miles.engines.base import GenerateRequest, GenerateResult, SamplingParams
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.fp8 import FP8
from miles.models.fp8_layout import quantize_hf_state, with_fp8
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.batch import TrainBatch, TrainSample
from miles.trainer.deterministic import request_seed
from miles.trainer.fsdp import FSDPTrainer

BLOCK = (32, 32)
PLAIN = ModelSpec.from_hf(tiny_config("qwen3", vocab_size=64, num_hidden_layers=2, initializer_range=0.1))
FP8_SPEC = with_fp8(PLAIN, BLOCK)


async def _rollout(engine: TorchEngine, step: int) -> tuple[list[list[int]], list[GenerateResult]]:
    rng = np.random.default_rng(step)
    ps = [rng.integers(0, 64, int(rng.integers(3, 7))).tolist() for _ in range(3)]
    reqs = [GenerateRequest(input_ids=p, sampling=SamplingParams(
        temperature=1.0, max_new_tokens=6, seed=request_seed(1, step, i, j)))
        for i, p in enumerate(ps) for j in range(2)]
    return ps, list(await asyncio.gather(*(engine.generate(r) for r in reqs)))


def _batch(ps: list[list[int]], res: list[GenerateResult]) -> TrainBatch:
    return TrainBatch([TrainSample(
        prompt_ids=np.asarray(ps[k // 2]), response_ids=np.asarray(r.output_ids),
        reward=float(np.mean([t % 2 == 0 for t in r.output_ids])), group_index=k // 2,
        rollout_logprobs=np.asarray(r.logprobs, np.float32), versions=np.asarray(r.versions, np.int64))
        for k, r in enumerate(res)])


async def _fp8_sync(trainer: FSDPTrainer, engine: TorchEngine, version: int) -> None:
    # the fp32 masters as exported (bf16 case: not cast to the compute dtype first): the codes
    # are those of the bf16-rounded weights either way, as in the trainer's forward
    named = ((n, t.detach()) for n, t in trainer.export_hf_state())
    staged = [(n, t.clone()) for n, t in quantize_hf_state(named, BLOCK)]
    assert any(t.dtype == FP8 for _, t in staged)
    await engine.stage(version, staged)
    await engine.commit(version)


async def _max_diff(trainer_spec: ModelSpec, dtype: torch.dtype, device: str = "cpu") -> float:
    cfg = TrainerConfig()
    cfg.device = device  # type: ignore[assignment]
    cfg.param_dtype = "bfloat16" if dtype == torch.bfloat16 else "float32"  # type: ignore[assignment]
    cfg.micro_batch_tokens = 64
    cfg.optim.lr = 1e-2
    cfg.true_on_policy = True
    cfg.correction.old_logprobs = "recompute"
    trainer = FSDPTrainer(cfg, trainer_spec, 0, 1, seed=5)
    engine = TorchEngine(build_model(FP8_SPEC, dtype=dtype, device=device, seed=9),
                         EngineConfig(max_batch_size=4, device=device),
                         batch_invariant=True)
    worst = 0.0
    try:
        await _fp8_sync(trainer, engine, 0)
        for step in range(2):  # the second rollout runs on trained, FP8-synced weights
            ps, res = await _rollout(engine, step)
            m = trainer.train_step(_batch(ps, res))
            worst = max(worst, m["train/train_rollout_logprob_abs_diff_max"])
            await _fp8_sync(trainer, engine, step + 1)
    finally:
        await engine.close()
        trainer.close()
    return worst


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
async def test_true_on_policy_under_the_fp8_contract_is_exact(dtype: torch.dtype) -> None:
    assert await _max_diff(FP8_SPEC, dtype) == 0.0


@pytest.mark.timeout(120)
async def test_quantizing_only_the_engine_breaks_it() -> None:
    # the paper's counter-example the other way round: one side quantized, the other not
    assert await _max_diff(PLAIN, torch.float32) > 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the H200 bf16 check)")
@pytest.mark.timeout(300)
async def test_true_on_policy_under_the_fp8_contract_on_cuda_bf16() -> None:
    assert await _max_diff(FP8_SPEC, torch.bfloat16, "cuda") == 0.0
