"""One-rank FSDP trainer: R3 replay, exact resume, HF export, estimators, bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from miles.core.config import load_config
from miles.core.errors import ConfigError, TrainerError
from miles.core.schema import MilesConfig
from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.batch import TrainBatch
from miles.trainer.forward import moe_gates
from miles.trainer.fsdp import FSDPTrainer
from miles.trainer.synthetic import engine_batch


def _cfg(**kw: object) -> TrainerConfig:
    cfg = TrainerConfig()
    cfg.device = "cpu"
    cfg.micro_batch_tokens = 40
    cfg.optim.lr = 1e-3
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def _perturb_router(trainer: FSDPTrainer, scale: float) -> None:
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for gate in moe_gates(trainer.policy):
            w = gate.weight.to_local() if hasattr(gate.weight, "to_local") else gate.weight
            w.add_(torch.randn(w.shape, generator=g) * scale)


def test_r3_replay_matches_engine_logprobs() -> None:
    # top-1 with renormalisation: the gate weight is exactly 1 for any router scores, so a
    # perturbed router changes only which expert is chosen - exactly what R3 must undo
    spec = ModelSpec.from_hf(tiny_config("qwen3_moe", vocab_size=64, num_experts_per_tok=1))
    batch = engine_batch(build_model(spec, seed=1), groups=3, group_size=2, seed=4)
    res = {}
    for replay in (True, False):
        t = FSDPTrainer(_cfg(routing_replay=replay), spec, 0, 1, seed=1)
        _perturb_router(t, 0.5)
        res[replay] = t.train_step(batch)
        t.close()
    on, off = res[True], res[False]
    assert on["train/train_rollout_logprob_abs_diff_max"] < 1e-5
    assert off["train/train_rollout_logprob_abs_diff_max"] > 1e-3
    assert on["train/routing_overlap"] < 0.9 and off["train/routing_overlap"] < 0.9
    assert on["train/ess_ratio"] == pytest.approx(1.0, abs=1e-6)


def test_resume_reproduces_next_steps(tmp_path: Path) -> None:
    spec = ModelSpec.from_hf(tiny_config("qwen3", vocab_size=64, num_hidden_layers=1))
    batches = [
        engine_batch(build_model(spec, seed=2), groups=2, group_size=2, seed=s) for s in range(3)
    ]
    cfg = _cfg(deterministic=True)
    cfg.optim.warmup_steps = 2
    a = FSDPTrainer(cfg, spec, 0, 1, seed=2)
    a.train_step(batches[0])
    a.save_checkpoint(tmp_path / "ck")
    ref = [a.train_step(b)["train/loss"] for b in batches[1:]]
    b = FSDPTrainer(cfg, spec, 0, 1, seed=99)
    b.load_checkpoint(tmp_path / "ck")
    assert b.weight_version == 1 and b.opt_steps == 1
    got = [b.train_step(x)["train/loss"] for x in batches[1:]]
    assert got == ref


def test_export_hf_checkpoint_loads_in_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    spec = ModelSpec.from_hf(tiny_config("qwen3", vocab_size=64, num_hidden_layers=1))
    t = FSDPTrainer(_cfg(), spec, 0, 1, seed=3)
    t.train_step(engine_batch(build_model(spec, seed=3), groups=2, group_size=2, seed=0))
    t.export_hf_checkpoint(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    ours = build_model(spec)
    from miles.models.hf_io import load_hf_tensors

    load_hf_tensors(ours, t.export_hf_state())
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, ours(ids).logits, atol=1e-4)


@pytest.mark.parametrize("estimator", ["gspo", "cispo", "reinforce_pp", "ppo"])
def test_estimators_run_and_learn(estimator: str) -> None:
    spec = ModelSpec.from_hf(tiny_config("qwen3_moe", vocab_size=64, num_hidden_layers=1))
    batch = engine_batch(build_model(spec, seed=6), groups=2, group_size=3, seed=1)
    cfg = _cfg()
    cfg.advantage.estimator = estimator  # type: ignore[assignment]
    cfg.loss.aggregation = "seq_mean_token_mean"
    cfg.loss.kl_coef = 0.05
    cfg.loss.kl_in_reward = estimator in ("reinforce_pp", "ppo")
    cfg.mini_batches = 2
    t = FSDPTrainer(cfg, spec, 0, 1, seed=6)
    m1 = t.train_step(batch)
    m2 = t.train_step(batch)
    for m in (m1, m2):
        assert all(np.isfinite(v) for v in m.values())
    assert m2["train/train_rollout_logprob_abs_diff"] > 0  # the policy moved
    if estimator == "ppo":
        assert "train/value_loss" in m1


def test_bad_input_errors() -> None:
    spec = ModelSpec.from_hf(tiny_config("qwen3_moe", vocab_size=64, num_hidden_layers=1))
    batch = engine_batch(build_model(spec, seed=0), groups=1, group_size=2, seed=0)
    with pytest.raises(ConfigError, match="asynchronous"):  # checked once, when the config is loaded
        load_config(MilesConfig, None, ["trainer.correction.types=[]", "buffer.mode=fully_async"])
    t = FSDPTrainer(_cfg(), spec, 0, 1)
    with pytest.raises(TrainerError, match="empty batch"):
        t.train_step(TrainBatch([]))
    batch.samples[1].rollout_logprobs = None
    with pytest.raises(TrainerError, match="sample 1 .*no rollout_logprobs"):
        t.train_step(batch)
    other = ModelSpec.from_hf(tiny_config("qwen3_moe", vocab_size=64, num_hidden_layers=2))
    wrong = engine_batch(build_model(other, seed=0), groups=1, group_size=1, seed=0)
    with pytest.raises(TrainerError, match="routed_experts: per-token shape"):
        t.train_step(wrong)
