"""Rollout/trainer mismatch corrections: TIS, Clip-or-Pop, MIS, OPSM, and their metrics.

The importance weight of a token is w = exp(logp_old - logp_rollout): how much more the
trainer's old policy likes the sampled token than the engine that sampled it did.
- TIS multiplies the token's loss by min(w, cap).
- Clip-or-Pop keeps w as the multiplier inside [low, high] and pops (zero gradient) tokens
  outside it, instead of scaling them.
- MIS computes the weight per token, per sequence (product) or as the per-sequence geometric
  mean; then truncates it at `mis_high` or masks what falls outside [mis_low, mis_high]; a
  sequence with any token weight below `mis_veto` is dropped entirely.
- OPSM masks a sequence whose advantage is negative and whose mean per-token
  KL(rollout || current) exceeds delta (the current policy has moved too far from the
  data to push probability down on it safely).
Weights and masks are detached: they scale gradients, they do not receive them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.core.schema.trainer import CorrectionConfig
from miles.trainer.metrics import StepMetrics
from miles.trainer.policy_loss import sequence_log_ratio

_CLAMP = 20.0


def needs_rollout_logprobs(cfg: CorrectionConfig) -> bool:
    return bool(cfg.types) or cfg.old_logprobs == "rollout"


@dataclass
class Correction:
    weight: torch.Tensor  # [M] multiplier of each token's loss (detached)
    keep: torch.Tensor  # [M] 0/1: 0 = zero gradient for the token


def _seq_any(flag: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    hits = torch.zeros(num_seqs, dtype=torch.float32, device=flag.device)
    return hits.index_add(0, seq, flag.float()) > 0


def apply_corrections(
    cfg: CorrectionConfig,
    *,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    cur_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    seq: torch.Tensor,
    num_seqs: int,
    metrics: StepMetrics | None = None,
) -> Correction:
    """Weights and keep-mask for one micro-batch's response tokens (all [M])."""
    old_logp, rollout_logp, cur_logp = old_logp.detach(), rollout_logp.detach(), cur_logp.detach()
    m = (mask > 0).float()
    n = m.sum()
    log_w = (old_logp - rollout_logp).clamp(-_CLAMP, _CLAMP)
    w = torch.exp(log_w)
    weight = torch.ones_like(w)
    keep = m.clone()
    if "tis" in cfg.types:
        weight = w.clamp(max=cfg.tis_cap)
        if metrics is not None:
            metrics.add_mean("train/tis_fraction", ((w > cfg.tis_cap).float() * m).sum(), n)
    if "clip_or_pop" in cfg.types:
        inside = (w >= cfg.pop_low) & (w <= cfg.pop_high)
        weight = torch.where(inside, w, torch.zeros_like(w))
        keep = keep * inside.float()
        if metrics is not None:
            metrics.add_mean("train/clip_or_pop_fraction", ((~inside).float() * m).sum(), n)
    if "mis" in cfg.types:
        weight, keep = _mis(cfg, log_w, w, m, keep, seq, num_seqs, metrics, n)
    if "opsm" in cfg.types:
        kl = sequence_log_ratio(rollout_logp - cur_logp, m, seq, num_seqs)
        seq_adv = sequence_log_ratio(adv.detach().float(), m, seq, num_seqs)
        drop = (seq_adv < 0) & (kl > cfg.opsm_delta)
        keep = keep * (~drop[seq]).float()
        if metrics is not None:
            metrics.add_mean("train/opsm_masked_fraction", (drop[seq].float() * m).sum(), n)
    return Correction(weight=weight.detach(), keep=keep.detach())


def _mis(
    cfg: CorrectionConfig,
    log_w: torch.Tensor,
    w: torch.Tensor,
    m: torch.Tensor,
    keep: torch.Tensor,
    seq: torch.Tensor,
    num_seqs: int,
    metrics: StepMetrics | None,
    n: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if cfg.mis_level == "token":
        lw = log_w
    else:
        mean_lw = sequence_log_ratio(log_w, m, seq, num_seqs)
        if cfg.mis_level == "sequence":
            cnt = torch.zeros(num_seqs, dtype=m.dtype, device=m.device).index_add(0, seq, m)
            mean_lw = mean_lw * cnt
        lw = mean_lw[seq].clamp(-_CLAMP, _CLAMP)
    level_w = torch.exp(lw)
    if cfg.mis_mode == "truncate":
        weight = level_w.clamp(max=cfg.mis_high)
        changed = (level_w > cfg.mis_high).float()
    else:
        inside = (level_w >= cfg.mis_low) & (level_w <= cfg.mis_high)
        weight = torch.where(inside, level_w, torch.zeros_like(level_w))
        keep = keep * inside.float()
        changed = (~inside).float()
    if cfg.mis_veto > 0:
        vetoed = _seq_any((w < cfg.mis_veto) & (m > 0), seq, num_seqs)[seq]
        keep = keep * (~vetoed).float()
        weight = torch.where(vetoed, torch.zeros_like(weight), weight)
        if metrics is not None:
            metrics.add_mean("train/mis_veto_fraction", (vetoed.float() * m).sum(), n)
    if metrics is not None:
        metrics.add_mean("train/mis_fraction", (changed * m).sum(), n)
    return weight, keep


def mismatch_metrics(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, metrics: StepMetrics
) -> None:
    """Rollout/trainer divergence at the sampled tokens (the paper's Figure 5b quantity).

    train_rollout_kl is the k3 estimate of KL(rollout || trainer-old) from the rollout's own
    samples; ess_ratio is (sum w)^2 / (n sum w^2), 1 when the two policies agree.
    """
    m = (mask > 0).float()
    n = m.sum()
    d = (old_logp.detach() - rollout_logp.detach()).clamp(-_CLAMP, _CLAMP)
    w = torch.exp(d)
    metrics.add_mean("train/train_rollout_logprob_abs_diff", (d.abs() * m).sum(), n)
    big = (d.abs() * m).max() if m.numel() else torch.zeros(())
    metrics.add_max("train/train_rollout_logprob_abs_diff_max", big)
    metrics.add_mean("train/train_rollout_kl", ((w - 1.0 - d) * m).sum(), n)
    metrics.add_mean("_ess/w", (w * m).sum(), n)
    metrics.add_mean("_ess/w2", (w * w * m).sum(), n)


def finish_ess(values: dict[str, float]) -> None:
    """Replace the reduced `_ess/*` means by `train/ess_ratio` = mean(w)^2 / mean(w^2)."""
    mw = values.pop("_ess/w", 0.0)
    mw2 = values.pop("_ess/w2", 0.0)
    values["train/ess_ratio"] = (mw * mw) / mw2 if mw2 > 0 else 1.0
