"""Advantage estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from miles.core.errors import TrainerError
from miles.trainer.advantages import (
    discounted_returns,
    gae,
    group_advantages,
    token_rewards,
    whiten,
)


def test_grpo_and_dr_grpo() -> None:
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 5.0, 5.0, 3.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    a = group_advantages(r, g, std_normalize=True, eps=0.0)
    std = math.sqrt((4 * 0.25) / 3)  # unbiased std of [1, 0, 1, 0]
    assert torch.allclose(a[:4], torch.tensor([0.5, -0.5, 0.5, -0.5]) / std)
    assert a[4:].tolist() == [0.0, 0.0, 0.0]  # zero-variance group and singleton: no signal
    d = group_advantages(r, g, std_normalize=False)
    assert d.tolist() == [0.5, -0.5, 0.5, -0.5, 0.0, 0.0, 0.0]
    with pytest.raises(TrainerError):
        group_advantages(r, g[:3])


def test_token_rewards_and_returns() -> None:
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0.0, 0.0])]
    tr = token_rewards([2.0, 7.0], masks)
    assert tr[0].tolist() == [0.0, 2.0, 0.0] and tr[1].tolist() == [0.0, 0.0]
    kl = [torch.tensor([0.5, 1.0, 3.0]), torch.zeros(2)]
    tr = token_rewards([2.0, 7.0], masks, kl, kl_coef=0.1)
    assert torch.allclose(tr[0], torch.tensor([-0.05, 1.9, 0.0]))
    g = discounted_returns([torch.tensor([1.0, 0.0, 2.0])], gamma=0.5)
    assert g[0].tolist() == [1.5, 1.0, 2.0]


def test_gae_hand_values() -> None:
    r = [torch.tensor([0.0, 1.0])]
    v = [torch.tensor([0.5, 0.25])]
    adv, ret = gae(r, v, gamma=0.9, lam=0.8)
    d1 = 1.0 - 0.25
    d0 = 0.0 + 0.9 * 0.25 - 0.5
    assert torch.allclose(adv[0], torch.tensor([d0 + 0.9 * 0.8 * d1, d1]))
    assert torch.allclose(ret[0], adv[0] + v[0])
    a1, _ = gae(r, v, gamma=1.0, lam=1.0)  # lambda = 1: advantage = return - value
    assert torch.allclose(a1[0], torch.tensor([1.0 - 0.5, 1.0 - 0.25]))


def test_whiten_global_stats() -> None:
    vals = [torch.tensor([1.0, 2.0, 100.0]), torch.tensor([3.0])]
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0])]
    out = whiten(vals, masks, eps=0.0)
    flat = torch.tensor([out[0][0], out[0][1], out[1][0]])
    assert torch.allclose(flat.mean(), torch.tensor(0.0), atol=1e-6)
    assert torch.allclose(flat.pow(2).mean(), torch.tensor(1.0), atol=1e-5)
    # a "reduce" that doubles the sums (two identical ranks) leaves the result unchanged
    twice = whiten(vals, masks, reduce=lambda t: t * 2, eps=0.0)
    assert torch.allclose(twice[1], out[1])
    assert whiten([torch.ones(2)], [torch.zeros(2)])[0].tolist() == [0.0, 0.0]
