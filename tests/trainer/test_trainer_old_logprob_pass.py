"""The old-logprob no-grad pass is skipped only where it is redundant, with identical numerics.

With one optimizer step per batch the training forward runs at the step's start weights,
so its detached logprobs are the recompute pass's values: loss, metrics and gradients
must match the path that runs the pass ('always') within fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch
from numerics import assert_reduced_close, forward_sums

from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.fsdp import FSDPTrainer
from miles.trainer.synthetic import engine_batch

pytestmark = pytest.mark.timeout(120)

SPEC = ModelSpec.from_hf(tiny_config("qwen3_moe", vocab_size=64, num_hidden_layers=2))


def _trainer(pass_: str, mini_batches: int = 1) -> tuple[FSDPTrainer, list[int]]:
    cfg = TrainerConfig()
    cfg.device = "cpu"
    cfg.micro_batch_tokens = 40  # several micro-batches: gradient accumulation across them
    cfg.mini_batches = mini_batches
    cfg.optim.lr = 1e-3
    cfg.correction.types = ["tis"]
    cfg.correction.old_logprobs_pass = pass_  # type: ignore[assignment]
    t = FSDPTrainer(cfg, SPEC, 0, 1, seed=5)
    calls = [0]
    # counts policy forwards (the thing measured, not replaced)
    t.policy.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return t, calls


def _grads(t: FSDPTrainer) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in t.policy.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def test_single_update_skips_the_pass_with_the_same_numbers() -> None:
    batch = engine_batch(build_model(SPEC, seed=3), groups=3, group_size=3, seed=7)
    fused, n_fused = _trainer("auto")
    ref, n_ref = _trainer("always")
    for _ in range(2):  # the second step trains off-policy data (weights moved): ratio != rollout
        m_f, m_r = fused.train_step(batch), ref.train_step(batch)
        for k in ("train/loss", "train/pg_loss", "train/ratio_mean", "train/clip_fraction",
                  "train/train_rollout_logprob_abs_diff", "train/routing_overlap", "train/grad_norm",
                  "train/tis_fraction", "train/entropy"):
            assert m_f[k] == pytest.approx(m_r[k], rel=1e-5, abs=1e-7), k
        assert m_f["train/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        g_f, g_r = _grads(fused), _grads(ref)
        assert g_f.keys() == g_r.keys() and g_f
        k, depth = forward_sums(SPEC, sum(x.total_len for x in batch.samples))
        for n in g_f:
            assert_reduced_close(g_f[n], g_r[n], k=k, depth=2 * depth, what=n)
    micro = n_fused[0] // 2
    assert micro >= 2, "the batch should span several micro-batches"
    assert n_ref[0] == 2 * n_fused[0]  # 'always': one extra forward per micro-batch
    fused.close()
    ref.close()


def test_several_mini_batches_keep_the_pass() -> None:
    batch = engine_batch(build_model(SPEC, seed=3), groups=4, group_size=2, seed=8)
    auto, n_auto = _trainer("auto", mini_batches=2)
    always, n_always = _trainer("always", mini_batches=2)
    m_a, m_b = auto.train_step(batch), always.train_step(batch)
    assert n_auto[0] == n_always[0]  # the second mini-batch needs the start weights' logprobs
    assert m_a["train/loss"] == pytest.approx(m_b["train/loss"], rel=1e-6)
    auto.close()
    always.close()
