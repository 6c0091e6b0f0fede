"""Advantage estimators: GRPO / Dr.GRPO group normalisation, REINFORCE++ returns, PPO GAE.

GSPO and CISPO use GRPO's group-normalised advantages; they differ in the loss
(trainer/policy_loss.py). Token-level estimators work on a list of 1-D response tensors,
one per sample, so per-sequence recurrences stay simple; batch statistics that must span
all DP ranks take a `reduce` callable (sum-all-reduce; identity on one rank).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from miles.core.errors import TrainerError

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def group_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, *, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sample advantage r - mean(group), divided by the group std when `std_normalize`.

    The std is the unbiased one; a group of one sample, or one whose rewards are all equal,
    has zero advantage (it carries no preference signal) rather than NaN or a 0/eps blow-up.
    """
    if rewards.shape != groups.shape or rewards.dim() != 1:
        raise TrainerError(
            f"group_advantages: rewards {tuple(rewards.shape)} and groups {tuple(groups.shape)} "
            "must be equal 1-D shapes"
        )
    r = rewards.to(torch.float64)
    uniq, inv = torch.unique(groups, return_inverse=True)
    g = uniq.numel()
    count = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, r) / count
    centred = r - mean[inv]
    if not std_normalize:
        return centred.to(torch.float32)
    sq = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, centred * centred)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    flat = std[inv] <= 1e-12
    adv = torch.where(flat, torch.zeros_like(centred), centred / (std[inv] + eps))
    return adv.to(torch.float32)


def token_rewards(
    rewards: Sequence[float],
    masks: Sequence[torch.Tensor],
    kl: Sequence[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
) -> list[torch.Tensor]:
    """Per-token rewards: the outcome reward on each response's last loss token, minus
    `kl_coef * kl` on every loss token when a per-token KL is given."""
    out = []
    for i, (r, m) in enumerate(zip(rewards, masks, strict=True)):
        t = torch.zeros(m.numel(), dtype=torch.float32)
        nz = torch.nonzero(m > 0)
        if nz.numel():
            t[int(nz[-1])] = float(r)
        if kl is not None and kl_coef:
            if kl[i].shape != m.shape:
                raise TrainerError(f"token_rewards: kl[{i}] shape {tuple(kl[i].shape)} != mask")
            t = t - kl_coef * kl[i].float() * (m > 0)
        out.append(t)
    return out


def discounted_returns(rewards: Sequence[torch.Tensor], gamma: float) -> list[torch.Tensor]:
    """G_t = r_t + gamma * G_{t+1} per response (REINFORCE++ returns)."""
    out = []
    for r in rewards:
        g = torch.zeros_like(r)
        acc = torch.zeros((), dtype=r.dtype)
        for t in range(r.numel() - 1, -1, -1):
            acc = r[t] + gamma * acc
            g[t] = acc
        out.append(g)
    return out


def gae(
    rewards: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    gamma: float,
    lam: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Generalised advantage estimation per response; the value after the last token is 0.

    Returns (advantages, returns = advantages + values).
    """
    advs, rets = [], []
    for i, (r, v) in enumerate(zip(rewards, values, strict=True)):
        if r.shape != v.shape:
            raise TrainerError(f"gae: rewards[{i}] {tuple(r.shape)} != values {tuple(v.shape)}")
        a = torch.zeros_like(r)
        last = torch.zeros((), dtype=r.dtype)
        for t in range(r.numel() - 1, -1, -1):
            nxt = v[t + 1] if t + 1 < r.numel() else torch.zeros((), dtype=r.dtype)
            delta = r[t] + gamma * nxt - v[t]
            last = delta + gamma * lam * last
            a[t] = last
        advs.append(a)
        rets.append(a + v)
    return advs, rets


def whiten(
    values: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    reduce: Reduce = _identity,
    eps: float = 1e-8,
    shift_mean: bool = True,
) -> list[torch.Tensor]:
    """Normalise token values to zero mean, unit std over all loss tokens of the global batch.

    `reduce` sums a small tensor over DP ranks so every rank uses the same statistics.
    """
    stats = torch.zeros(3, dtype=torch.float64)
    for v, m in zip(values, masks, strict=True):
        mk = (m > 0).to(torch.float64)
        vv = v.to(torch.float64)
        stats += torch.stack([(vv * mk).sum(), (vv * vv * mk).sum(), mk.sum()])
    stats = reduce(stats)
    n = float(stats[2])
    if n == 0:
        return [torch.zeros_like(v) for v in values]
    mean = float(stats[0]) / n
    var = max(float(stats[1]) / n - mean * mean, 0.0)
    scale = 1.0 / (var**0.5 + eps)
    return [((v - mean) * scale if shift_mean else v * scale).to(torch.float32) for v in values]
