"""Policy losses, KL estimators, entropy and aggregation against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from miles.core.config import load_config
from miles.core.errors import ConfigError, TrainerError
from miles.core.schema import MilesConfig
from miles.trainer.aggregation import Denominators, aggregate, local_denominators
from miles.trainer.kl import entropy_from_logits, kl_estimate
from miles.trainer.policy_loss import cispo, gspo, ppo_clip

L = math.log


def test_ppo_clip_higher_and_dual_clip() -> None:
    ratios = torch.tensor([1.5, 0.5, 1.1, 0.7, 5.0])
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0])
    old = torch.full((5,), -1.0)
    logp = (old + torch.log(ratios)).requires_grad_(True)
    out = ppo_clip(logp, old, adv, eps_low=0.2, eps_high=0.3)
    # A>0, r=1.5 -> clipped at 1.3; A<0, r=0.5 -> clipped at 0.8; r=1.1 unclipped;
    # A>0, r=0.7 -> max(-0.7, -0.8) = -0.7 (unclipped branch); A<0, r=5 -> 5 (no dual clip)
    assert torch.allclose(out.loss, torch.tensor([-1.3, 0.8, -1.1, -0.7, 5.0]), atol=1e-6)
    assert out.clipped.tolist() == [True, True, False, False, False]
    out.loss.sum().backward()
    assert logp.grad is not None
    assert (
        logp.grad[0] == 0 and logp.grad[1] == 0 and torch.isclose(logp.grad[2], torch.tensor(-1.1))
    )
    dual = ppo_clip(logp.detach(), old, adv, eps_low=0.2, eps_high=0.3, dual_clip_c=3.0)
    assert torch.isclose(dual.loss[4], torch.tensor(3.0)) and dual.dual_clipped.tolist()[4]
    assert not dual.dual_clipped[:4].any()
    with pytest.raises(TrainerError, match="dual_clip_c"):
        ppo_clip(logp, old, adv, 0.2, 0.3, dual_clip_c=0.5)


def test_gspo_sequence_ratio_is_geometric_mean() -> None:
    old = torch.zeros(4)
    logp = torch.tensor([L(2.0), L(0.5), L(1.2), 0.0], requires_grad=True)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    seq = torch.tensor([0, 0, 1, 1])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    out = gspo(logp, old, adv, mask, seq, 2, eps_low=0.1, eps_high=0.1)
    # seq 0: sqrt(2 * 0.5) = 1; seq 1: only the first token counts -> 1.2 (clipped to 1.1 for A<0)
    assert torch.allclose(out.ratio, torch.tensor([1.0, 1.0, 1.2, 1.2]), atol=1e-6)
    assert torch.allclose(out.loss, torch.tensor([-1.0, -1.0, 1.2, 1.2]), atol=1e-6)
    # gradient of the token form under a per-sequence token mean = sequence-level gradient
    (out.loss[:2].mean()).backward()
    assert logp.grad is not None
    assert torch.allclose(logp.grad[:2], torch.tensor([-0.5, -0.5]), atol=1e-6)


def test_cispo_keeps_gradient_of_clipped_tokens() -> None:
    old = torch.zeros(2)
    logp = torch.tensor([L(2.0), L(0.5)], requires_grad=True)
    adv = torch.tensor([1.0, 1.0])
    out = cispo(logp, old, adv, eps_low=1.0, eps_high=0.25)
    assert out.clipped.tolist() == [True, False]
    out.loss.sum().backward()
    assert logp.grad is not None
    assert torch.allclose(logp.grad, torch.tensor([-1.25, -0.5]))


def test_kl_estimators() -> None:
    logp = torch.tensor([L(0.5), L(0.25)])
    ref = torch.tensor([L(0.25), L(0.25)])
    assert torch.allclose(kl_estimate(logp, ref, "k1"), torch.tensor([L(2.0), 0.0]))
    assert torch.allclose(kl_estimate(logp, ref, "k2"), torch.tensor([0.5 * L(2.0) ** 2, 0.0]))
    assert torch.allclose(kl_estimate(logp, ref, "k3"), torch.tensor([0.5 - 1 + L(2.0), 0.0]))
    with pytest.raises(ConfigError, match="kl_estimator"):  # the loader takes only the Literal's values
        load_config(MilesConfig, None, ["trainer.loss.kl_estimator=k4"])


def test_entropy() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    e = entropy_from_logits(logits)
    assert torch.allclose(e, torch.tensor([L(4.0), 0.0]), atol=1e-5)
    # temperature 2 on logits [2 ln 3, 0]: probabilities 3/4, 1/4
    e2 = entropy_from_logits(torch.tensor([[2 * L(3.0), 0.0]]), temperature=2.0)
    assert torch.allclose(e2, torch.tensor([-(0.75 * L(0.75) + 0.25 * L(0.25))]))


def test_aggregation_modes_and_empty_masks() -> None:
    v = torch.tensor([1.0, 3.0, 10.0, 7.0, 7.0])
    m = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    seq = torch.tensor([0, 0, 1, 2, 2])
    d = local_denominators(m, seq, 3)
    assert d.tolist() == [3.0, 2.0]  # sequence 2 has an empty mask: counted nowhere
    den = Denominators(tokens=float(d[0]), seqs=float(d[1]))
    assert aggregate(v, m, seq, 3, "token_mean", den).item() == pytest.approx(14 / 3)
    assert aggregate(v, m, seq, 3, "seq_mean_token_mean", den).item() == pytest.approx((2 + 10) / 2)
    assert aggregate(v, m, seq, 3, "seq_mean_token_sum", den).item() == pytest.approx((4 + 10) / 2)
    zero = torch.zeros(5)
    assert aggregate(v, zero, seq, 3, "token_mean", Denominators(0.0, 0.0)).item() == 0.0
    with pytest.raises(ConfigError, match="aggregation"):
        load_config(MilesConfig, None, ["trainer.loss.aggregation=sum"])
