"""The full RL objective of one micro-batch: policy loss x corrections + KL + entropy (+ value).

Returns this micro-batch's share of the global mini-batch loss (see trainer/aggregation.py)
and records metrics. Popped/masked tokens contribute zero but still count in the
denominators, so the loss scale does not jump when a correction drops tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.core.errors import TrainerError
from miles.core.schema.trainer import TrainerConfig
from miles.trainer.aggregation import Denominators, aggregate
from miles.trainer.corrections import apply_corrections, mismatch_metrics
from miles.trainer.kl import kl_estimate
from miles.trainer.metrics import StepMetrics
from miles.trainer.policy_loss import cispo, gspo, ppo_clip


@dataclass
class LossInputs:
    """Response-view tensors of one micro-batch ([M] each)."""

    logp: torch.Tensor  # current policy, with grad
    old_logp: torch.Tensor | None  # no-grad pass at the step's start weights (None: use rollout)
    rollout_logp: torch.Tensor | None  # the engine's
    adv: torch.Tensor
    mask: torch.Tensor
    seq: torch.Tensor
    num_seqs: int
    ref_logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None  # with grad when entropy_coef != 0
    values: torch.Tensor | None = None  # critic, with grad (ppo)
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None


def rl_loss(
    cfg: TrainerConfig, x: LossInputs, denom: Denominators, metrics: StepMetrics
) -> torch.Tensor:
    lc, cc = cfg.loss, cfg.correction
    mode = lc.aggregation
    m = x.mask
    n = (m > 0).float().sum()
    old = x.old_logp if x.old_logp is not None else x.rollout_logp
    if old is None:
        raise TrainerError("rl_loss: neither old_logp nor rollout_logp given")
    weight = torch.ones_like(x.logp)
    keep = torch.ones_like(x.logp)
    if x.rollout_logp is not None:
        mismatch_metrics(old, x.rollout_logp, m, metrics)
        if cc.types:
            c = apply_corrections(
                cc,
                old_logp=old,
                rollout_logp=x.rollout_logp,
                cur_logp=x.logp,
                adv=x.adv,
                mask=m,
                seq=x.seq,
                num_seqs=x.num_seqs,
                metrics=metrics,
            )
            weight, keep = c.weight, c.keep
    est = cfg.advantage.estimator
    if est == "gspo":
        pl = gspo(
            x.logp,
            old,
            x.adv,
            m * keep,
            x.seq,
            x.num_seqs,
            lc.gspo_eps_clip_low,
            lc.gspo_eps_clip_high,
        )
    elif est == "cispo":
        pl = cispo(x.logp, old, x.adv, lc.eps_clip_low, lc.eps_clip_high)
    else:
        pl = ppo_clip(x.logp, old, x.adv, lc.eps_clip_low, lc.eps_clip_high, lc.dual_clip_c)
    pg = aggregate(pl.loss * weight * keep, m, x.seq, x.num_seqs, mode, denom)
    total = pg
    metrics.add_sum("train/pg_loss", pg.detach())
    mk = (m > 0).float()
    metrics.add_mean("train/clip_fraction", (pl.clipped.float() * mk).sum(), n)
    metrics.add_mean("train/dual_clip_fraction", (pl.dual_clipped.float() * mk).sum(), n)
    metrics.add_mean("train/ratio_mean", (pl.ratio * mk).sum(), n)
    if x.ref_logp is not None and lc.kl_coef and not lc.kl_in_reward:
        kl = kl_estimate(x.logp, x.ref_logp, lc.kl_estimator)
        kl_term = aggregate(kl, m, x.seq, x.num_seqs, mode, denom)
        total = total + lc.kl_coef * kl_term
        metrics.add_sum("train/kl_loss", kl_term.detach())
    if x.ref_logp is not None:
        k = kl_estimate(x.logp.detach(), x.ref_logp, lc.kl_estimator)
        metrics.add_mean("train/kl_ref", (k * mk).sum(), n)
    if x.entropy is not None:
        metrics.add_mean("train/entropy", (x.entropy.detach() * mk).sum(), n)
        if lc.entropy_coef:
            ent = aggregate(x.entropy, m, x.seq, x.num_seqs, mode, denom)
            total = total - lc.entropy_coef * ent
    if x.values is not None and x.returns is not None and x.old_values is not None:
        v = x.values
        v_clip = x.old_values + (v - x.old_values).clamp(-lc.value_clip, lc.value_clip)
        vf = 0.5 * torch.maximum((v - x.returns) ** 2, (v_clip - x.returns) ** 2)
        vf_term = aggregate(vf, m, x.seq, x.num_seqs, mode, denom)
        total = total + lc.value_coef * vf_term
        metrics.add_sum("train/value_loss", vf_term.detach())
    metrics.add_sum("train/loss", total.detach())
    return total
