"""The one definition of a token's logprob, shared by the engine (reports it) and the trainer.

logprob(token) = log_softmax(logits / temperature)[token], taken from the temperature-scaled
distribution BEFORE any top-p / top-k truncation. temperature <= 0 (greedy) counts as 1.
Computed in fp32.
"""

from __future__ import annotations

import torch


def scale_logits(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """fp32 logits / temperature (per row when a tensor of shape [..., 1]); <= 0 means 1."""
    x = logits.float()
    if isinstance(temperature, torch.Tensor):
        t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(x)
        return x / t
    return x / temperature if temperature > 0 and temperature != 1.0 else x


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """logits [..., V], targets [...] (int) -> fp32 logprobs [...] under softmax(logits / temperature)."""
    logp = torch.log_softmax(scale_logits(logits, temperature), dim=-1)
    return logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
