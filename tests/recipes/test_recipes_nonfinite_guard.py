"""The non-finite guard: a batch whose gradient is not finite takes no step, is counted, and the
engine's weights stay finite and unchanged; weights that are not finite are never publishable."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from miles.core.schema.engine import EngineConfig
from miles.core.schema.trainer import TrainerConfig
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.hf_io import checksums
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.fsdp import FSDPTrainer

from .rl_loop import prompts, rollout, sync, to_batch

SPEC = ModelSpec.from_hf(tiny_config("qwen3", vocab_size=48, num_hidden_layers=1))
HUGE = 3.0e38  # finite rewards whose advantages overflow every gradient they reach


def _trainer() -> FSDPTrainer:
    cfg = TrainerConfig()
    cfg.device = "cpu"
    cfg.micro_batch_tokens = 48
    cfg.optim.lr = 1e-2
    cfg.advantage.std_normalize = False  # advantages keep the rewards' scale
    return FSDPTrainer(cfg, SPEC, 0, 1, seed=3)


@pytest.mark.timeout(120)
async def test_nonfinite_gradient_is_skipped_and_never_reaches_the_engine() -> None:
    trainer = _trainer()
    engine = TorchEngine(build_model(SPEC, seed=3), EngineConfig(max_batch_size=4))
    try:
        await sync(trainer, engine, 0)
        ps = prompts(SPEC.vocab_size, 3, seed=1)
        ok = trainer.train_step(to_batch(ps, await rollout(engine, ps, 2, run_seed=1, step=0), 2))
        assert ok["train/skipped_nonfinite"] == 0 and math.isfinite(ok["train/grad_norm"])
        await sync(trainer, engine, 1)
        before, steps = checksums(engine.model), trainer.opt_steps

        res = await rollout(engine, ps, 2, run_seed=1, step=1)
        signs = itertools.cycle((HUGE, -HUGE))  # each group of two gets both signs
        bad = to_batch(ps, res, 2, reward=lambda ids: next(signs))
        rewards = {s.reward for s in bad.samples}
        assert rewards == {HUGE, -HUGE}, "the batch must mix both signs so advantages are huge"
        m = trainer.train_step(bad)
        assert m["train/skipped_nonfinite"] == 1 and m["train/skipped_nonfinite_total"] == 1
        assert math.isnan(m["train/grad_norm"])  # no update was applied to average over
        assert trainer.opt_steps == steps  # no optimizer step, the lr schedule did not move
        # the culprit micro-batch is named, and its replay under anomaly mode names the backward
        # function that first made a NaN (here the loss's, from the overflowing advantages)
        culprit = trainer._rl.last_culprit
        assert isinstance(culprit.get("micro_batch"), int) and culprit["params"]
        diag = culprit["diagnosis"]
        assert isinstance(diag, dict) and "Backward" in str(diag["anomaly"]) and "nan" in str(diag["anomaly"])
        assert diag["finite_with_math_attention"] is None  # CPU: no fused attention kernel runs
        assert trainer.nonfinite_weights() == []
        await sync(trainer, engine, 2)
        assert checksums(engine.model) == before  # the engine got the same (finite) weights
        assert all(torch.isfinite(p).all() for p in engine.model.parameters())

        good = trainer.train_step(to_batch(ps, await rollout(engine, ps, 2, run_seed=1, step=2), 2))
        assert good["train/skipped_nonfinite"] == 0 and trainer.opt_steps == steps + 1
    finally:
        await engine.close()
        trainer.close()


def test_nonfinite_weights_are_named() -> None:
    trainer = _trainer()
    try:
        assert trainer.nonfinite_weights() == []
        name, p = next(iter(trainer.policy.named_parameters()))
        with torch.no_grad():
            p.view(-1)[0] = float("nan")
        assert trainer.nonfinite_weights() == [name]
    finally:
        trainer.close()
