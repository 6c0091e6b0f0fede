"""Per-token policy-gradient losses: PPO-clip (clip-higher, dual-clip), GSPO, CISPO.

All functions take the response view of a micro-batch (1-D tensors of M tokens) and
return per-token losses; masking and aggregation happen in trainer/aggregation.py.
Each also returns boolean indicators used for clip-fraction metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.core.errors import TrainerError

# exp() of a log-ratio beyond this overflows float32 gradients; such tokens are clipped anyway.
_MAX_LOG_RATIO = 20.0


@dataclass
class PolicyLossOut:
    loss: torch.Tensor  # [M] per-token loss
    ratio: torch.Tensor  # [M] the ratio the loss used (detached)
    clipped: torch.Tensor  # [M] bool: the clipped branch was active
    dual_clipped: torch.Tensor  # [M] bool: the dual-clip bound was active


def _log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    if logp.shape != old_logp.shape:
        raise TrainerError(f"logp {tuple(logp.shape)} and old_logp {tuple(old_logp.shape)} differ")
    return (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def ppo_clip(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float = 0.0,
) -> PolicyLossOut:
    """max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); for A < 0 also capped at -c A."""
    if dual_clip_c and dual_clip_c <= 1.0:
        raise TrainerError(f"dual_clip_c must be > 1 (or 0 to disable), got {dual_clip_c}")
    ratio = torch.exp(_log_ratio(logp, old_logp))
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    dual = torch.zeros_like(clipped)
    if dual_clip_c:
        cap = -adv * dual_clip_c
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    return PolicyLossOut(loss, ratio.detach(), clipped, dual)


def sequence_log_ratio(
    log_ratio: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor, num_seqs: int
) -> torch.Tensor:
    """Per-sequence mean of `log_ratio` over its loss tokens -> [S] (0 for empty masks)."""
    m = mask.to(log_ratio.dtype)
    tot = torch.zeros(num_seqs, dtype=log_ratio.dtype, device=log_ratio.device)
    cnt = torch.zeros(num_seqs, dtype=log_ratio.dtype, device=log_ratio.device)
    tot = tot.index_add(0, seq, log_ratio * m)
    cnt = cnt.index_add(0, seq, m)
    return tot / cnt.clamp(min=1.0)


def gspo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    seq: torch.Tensor,
    num_seqs: int,
    eps_low: float,
    eps_high: float,
) -> PolicyLossOut:
    """GSPO with the sequence ratio s_i = exp(mean_t log(pi/pi_old)) (geometric mean).

    Written in the token form s_i * pi_t / sg(pi_t), whose value is s_i at every token and
    whose gradient under a per-sequence token mean equals the sequence-level GSPO gradient.
    """
    lr = _log_ratio(logp, old_logp)
    seq_lr = sequence_log_ratio(lr, mask, seq, num_seqs)
    tok = seq_lr.detach()[seq] + logp - logp.detach()
    ratio = torch.exp(tok.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    return PolicyLossOut(loss, ratio.detach(), clipped, torch.zeros_like(clipped))


def cispo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> PolicyLossOut:
    """CISPO: -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi; every token keeps a gradient."""
    ratio = torch.exp(_log_ratio(logp, old_logp)).detach()
    w = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    clipped = w != ratio
    loss = -w * adv * logp
    return PolicyLossOut(loss, ratio, clipped, torch.zeros_like(clipped))
