"""True on-policy with images: the FSDP trainer and the batch-invariant torch engine give
bitwise-equal logprobs for a VL policy over a real rollout whose prompts hold images (fp32,
CPU), across a weight sync after a train step; the default (batched) mode differs, so the
exact-0 check can fail."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from miles.core.images import expand_placeholders, patchify
from miles.core.schema.engine import EngineConfig
from miles.core.schema.trainer import TrainerConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.batch import TrainBatch, TrainSample
from miles.trainer.fsdp import FSDPTrainer

from .rl_loop import sync

VOCAB = 64
SPEC = ModelSpec.from_hf(tiny_config("qwen2_5_vl", vocab_size=VOCAB, initializer_range=0.1))
IMG = VOCAB - 1


async def worst_gap(true_on_policy: bool) -> float:
    cfg = TrainerConfig()
    cfg.micro_batch_tokens = 256
    cfg.optim.lr = 1e-2
    cfg.true_on_policy = true_on_policy
    cfg.correction.old_logprobs = "recompute"
    trainer = FSDPTrainer(cfg, SPEC, 0, 1, seed=5)
    engine = TorchEngine(build_model(SPEC, seed=9), EngineConfig(max_batch_size=8), batch_invariant=true_on_policy)
    rng = np.random.default_rng(0)
    worst = 0.0
    try:
        await sync(trainer, engine, 0)
        for step in range(2):
            imgs = [patchify(rng.random((8 * (1 + i % 2), 16, 3)), 4, 2, 2) for i in range(4)]
            ps = [expand_placeholders([1, 2, IMG, *rng.integers(3, 40, 1 + i).tolist()], im.tokens(2), IMG)
                  for i, im in enumerate(imgs)]
            reqs = [GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=6, seed=100 * step + k),
                                    images=imgs[k // 2]) for k, p in enumerate(q for q in ps for _ in range(2))]
            res = await asyncio.gather(*(engine.generate(r) for r in reqs))
            samples = [TrainSample(r.input_ids, o.output_ids, float(len(o.output_ids) % 2), group_index=k // 2,
                                   rollout_logprobs=o.logprobs, versions=o.versions, pixels=r.images.pixels,
                                   image_grid=r.images.grid)
                       for k, (r, o) in enumerate(zip(reqs, res, strict=True)) if r.images is not None]
            m = trainer.train_step(TrainBatch(samples))
            worst = max(worst, m["train/train_rollout_logprob_abs_diff_max"])
            await sync(trainer, engine, step + 1)
    finally:
        await engine.close()
        trainer.close()
    return worst


@pytest.mark.timeout(240)
async def test_vl_true_on_policy_is_bitwise_and_the_default_mode_is_not() -> None:
    assert await worst_gap(True) == 0.0
    assert await worst_gap(False) > 0.0
