"""TIS, Clip-or-Pop, MIS, OPSM and mismatch metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from miles.core.config import from_dict, load_config
from miles.core.errors import ConfigError
from miles.core.schema import MilesConfig
from miles.core.schema.trainer import CorrectionConfig, TrainerConfig
from miles.trainer.aggregation import Denominators
from miles.trainer.corrections import (
    apply_corrections,
    finish_ess,
    mismatch_metrics,
)
from miles.trainer.metrics import StepMetrics
from miles.trainer.rl_loss import LossInputs, rl_loss

L = math.log


def _cfg(**kw: object) -> CorrectionConfig:
    return from_dict(CorrectionConfig, dict(kw))


def _run(
    cfg: CorrectionConfig, w: list[float], **kw: object
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    rollout = torch.full((len(w),), -1.0)
    old = rollout + torch.log(torch.tensor(w))
    met = StepMetrics()
    args: dict = {
        "old_logp": old,
        "rollout_logp": rollout,
        "cur_logp": old,
        "adv": torch.ones(len(w)),
        "mask": torch.ones(len(w)),
        "seq": torch.zeros(len(w), dtype=torch.long),
        "num_seqs": 1,
        "metrics": met,
    }
    args.update(kw)
    c = apply_corrections(cfg, **args)
    return c.weight, c.keep, met.reduce()


def test_tis_truncates() -> None:
    wt, keep, m = _run(_cfg(types=["tis"], tis_cap=2.0), [0.5, 1.0, 3.0, 8.0])
    assert torch.allclose(wt, torch.tensor([0.5, 1.0, 2.0, 2.0]))
    assert keep.tolist() == [1, 1, 1, 1]
    assert m["train/tis_fraction"] == pytest.approx(0.5)


def test_clip_or_pop_drops_outside() -> None:
    wt, keep, m = _run(_cfg(types=["clip_or_pop"], pop_low=0.5, pop_high=2.0), [0.4, 1.5, 2.5, 0.5])
    assert keep.tolist() == [0, 1, 0, 1]
    assert torch.allclose(wt, torch.tensor([0.0, 1.5, 0.0, 0.5]))
    assert m["train/clip_or_pop_fraction"] == pytest.approx(0.5)


def test_all_tokens_popped_gives_zero_loss_and_zero_grad() -> None:
    cfg = TrainerConfig()
    cfg.correction = _cfg(types=["clip_or_pop"], pop_low=0.9, pop_high=1.1)
    rollout = torch.full((3,), -1.0)
    old = rollout + L(3.0)
    logp = old.clone().requires_grad_(True)
    met = StepMetrics()
    x = LossInputs(
        logp=logp,
        old_logp=old,
        rollout_logp=rollout,
        adv=torch.ones(3),
        mask=torch.ones(3),
        seq=torch.zeros(3, dtype=torch.long),
        num_seqs=1,
    )
    loss = rl_loss(cfg, x, Denominators(3.0, 1.0), met)
    loss.backward()
    assert loss.item() == 0.0
    assert logp.grad is not None and logp.grad.abs().sum().item() == 0.0
    vals = met.reduce()
    assert vals["train/clip_or_pop_fraction"] == 1.0


def test_mis_levels_and_modes() -> None:
    w = [0.5, 4.0]  # sequence product 2, geometric mean sqrt(2)
    wt, _, _ = _run(_cfg(types=["mis"], mis_level="token", mis_high=2.0, mis_veto=0.0), w)
    assert torch.allclose(wt, torch.tensor([0.5, 2.0]))
    wt, _, _ = _run(_cfg(types=["mis"], mis_level="sequence", mis_high=3.0, mis_veto=0.0), w)
    assert torch.allclose(wt, torch.tensor([2.0, 2.0]))
    wt, _, _ = _run(_cfg(types=["mis"], mis_level="geometric", mis_high=3.0, mis_veto=0.0), w)
    assert torch.allclose(wt, torch.full((2,), math.sqrt(2.0)))
    wt, keep, m = _run(
        _cfg(types=["mis"], mis_level="sequence", mis_mode="mask", mis_high=1.5, mis_veto=0.0), w
    )
    assert keep.tolist() == [0, 0] and wt.tolist() == [0, 0]
    assert m["train/mis_fraction"] == 1.0
    # veto: one token with weight below the threshold drops its whole sequence only
    seq = torch.tensor([0, 0, 1])
    wt, keep, m = _run(_cfg(types=["mis"], mis_veto=0.01), [0.001, 1.0, 1.0], seq=seq, num_seqs=2)
    assert keep.tolist() == [0, 0, 1] and wt.tolist() == [0, 0, 1]
    assert m["train/mis_veto_fraction"] == pytest.approx(2 / 3)


def test_opsm_masks_negative_far_sequences() -> None:
    cfg = _cfg(types=["opsm"], opsm_delta=0.1)
    rollout = torch.full((4,), -1.0)
    cur = torch.tensor([-1.5, -1.5, -1.5, -1.05])  # seq KL 0.5, 0.5 | 0.5, 0.05 (mean 0.275)
    seq = torch.tensor([0, 0, 1, 1])
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0])
    c = apply_corrections(
        cfg,
        old_logp=rollout,
        rollout_logp=rollout,
        cur_logp=cur,
        adv=adv,
        mask=torch.ones(4),
        seq=seq,
        num_seqs=2,
    )
    assert c.keep.tolist() == [0, 0, 1, 1]  # positive-advantage sequence is kept although far
    c2 = apply_corrections(
        cfg,
        old_logp=rollout,
        rollout_logp=rollout,
        cur_logp=cur,
        adv=-adv.abs(),
        mask=torch.ones(4),
        seq=seq,
        num_seqs=2,
    )
    assert c2.keep.tolist() == [0, 0, 0, 0]


def test_mismatch_metrics_hand_values() -> None:
    rollout = torch.tensor([-1.0, -2.0, -3.0])
    old = torch.tensor([-1.0, -2.0 + L(2.0), -9.0])
    mask = torch.tensor([1.0, 1.0, 0.0])
    met = StepMetrics()
    mismatch_metrics(old, rollout, mask, met)
    v = met.reduce()
    finish_ess(v)
    assert v["train/train_rollout_logprob_abs_diff"] == pytest.approx(L(2.0) / 2)
    assert v["train/train_rollout_logprob_abs_diff_max"] == pytest.approx(L(2.0))
    assert v["train/train_rollout_kl"] == pytest.approx((2 - 1 - L(2.0)) / 2)
    assert v["train/ess_ratio"] == pytest.approx((1.5**2) / 2.5)


def test_config_checks() -> None:
    """The loader checks the corrections (core/schema: the section, and across sections the
    orchestration mode); nothing downstream checks them again."""
    def load(*sets: str) -> MilesConfig:
        return load_config(MilesConfig, None, list(sets))

    with pytest.raises(ConfigError, match="asynchronous"):
        load("trainer.correction.types=[]", "buffer.mode=fully_async")
    load("trainer.correction.types=[]", "buffer.mode=sync")
    with pytest.raises(ConfigError, match="choose one"):
        load('trainer.correction.types=["tis", "mis"]')
    load('trainer.correction.types=["tis", "opsm"]')
    with pytest.raises(ConfigError, match="pop_low"):
        load('trainer.correction.types=["clip_or_pop"]', "trainer.correction.pop_low=1.5")
    with pytest.raises(ConfigError, match="not one of"):
        from_dict(CorrectionConfig, {"types": ["bogus"]})
