"""KL-to-reference estimators (k1, k2, k3) and the entropy of the sampling distribution.

All estimators are per token, for samples drawn from the current policy, with
log_ratio = logp - ref_logp:
  k1 = log_ratio                       (unbiased, can be negative)
  k2 = log_ratio^2 / 2                 (biased, low variance, gradient = k1's score form)
  k3 = exp(-log_ratio) - 1 + log_ratio (unbiased, non-negative)
"""

from __future__ import annotations

import torch

from miles.core.errors import TrainerError
from miles.core.schema.trainer import KlEstimator

_CLAMP = 20.0


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KlEstimator) -> torch.Tensor:
    if logp.shape != ref_logp.shape:
        raise TrainerError(
            f"kl: logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ"
        )
    lr = (logp - ref_logp).clamp(-_CLAMP, _CLAMP)
    if kind == "k1":
        return lr
    if kind == "k2":
        return 0.5 * lr * lr
    return torch.exp(-lr) - 1.0 + lr  # k3


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the last dim, in float32."""
    z = logits.float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
