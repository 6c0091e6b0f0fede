"""One fp32 rank trains plain modules, not FSDP2-wrapped ones, with the same numbers.

At world size 1 FSDP2 only adds hooks and identity copies (gather, reduce, reshard over a
group of one), so the unwrapped trainer must match the wrapped one step for step: metrics,
gradient norms, weights and optimizer state.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.fsdp import FSDPTrainer
from miles.trainer.synthetic import engine_batch

pytestmark = pytest.mark.timeout(120)


class WrappedTrainer(FSDPTrainer):
    wrap_single_rank = True  # the FSDP2 path a single rank took before


def _cfg() -> TrainerConfig:
    cfg = TrainerConfig()
    cfg.device = "cpu"
    cfg.micro_batch_tokens = 40  # several micro-batches: gradient accumulation across them
    cfg.optim.lr = 1e-3
    cfg.optim.grad_clip = 0.5
    cfg.loss.kl_coef = 0.01  # a reference model too
    cfg.correction.types = ["tis"]
    return cfg


def _state(t: FSDPTrainer) -> dict[str, torch.Tensor]:
    out = {k: v.detach().clone() for k, v in t.export_hf_state()}
    for i, st in enumerate(t.opt.state.values()):
        for k, v in st.items():
            out[f"opt.{i}.{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


def test_plain_single_rank_matches_fsdp2_wrapped() -> None:
    spec = ModelSpec.from_hf(tiny_config("qwen3_moe", vocab_size=64, num_hidden_layers=2))
    engine = build_model(spec, seed=3)
    batches = [engine_batch(engine, groups=3, group_size=3, seed=s) for s in range(3)]
    plain = FSDPTrainer(_cfg(), spec, 0, 1, seed=5)
    wrapped = WrappedTrainer(_cfg(), spec, 0, 1, seed=5)
    assert not any(isinstance(p, DTensor) for p in plain.trainable.parameters())
    assert all(isinstance(p, DTensor) for p in wrapped.trainable.parameters())
    for b in batches:
        mp, mw = plain.train_step(b), wrapped.train_step(b)
        for k in ("train/loss", "train/pg_loss", "train/kl_loss", "train/grad_norm", "train/entropy",
                  "train/ratio_mean", "train/routing_overlap", "train/train_rollout_logprob_abs_diff"):
            assert mp[k] == pytest.approx(mw[k], rel=1e-6, abs=1e-8), k
    sp, sw = _state(plain), _state(wrapped)
    assert sp.keys() == sw.keys() and any(k.startswith("opt.") for k in sp)
    for k in sp:
        torch.testing.assert_close(sp[k], sw[k], rtol=1e-6, atol=1e-8, msg=k)
    # the optimizer moved the weights away from the start: the comparison is not vacuous
    start = dict(WrappedTrainer(_cfg(), spec, 0, 1, seed=5).export_hf_state())
    assert any(not torch.equal(start[k], sp[k]) for k in start)
    plain.close()
    wrapped.close()
