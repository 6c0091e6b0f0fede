"""Loss aggregation: per-token losses -> this micro-batch's share of the global-batch loss.

Denominators are global (all micro-batches of the mini-batch on all DP ranks), so summing
the returned shares over micro-batches and ranks gives exactly the configured mean,
whatever the packing or sharding:
  token_mean          sum(loss * mask) / total loss tokens
  seq_mean_token_mean sum over sequences of (token mean of the sequence) / total sequences
  seq_mean_token_sum  sum over sequences of (token sum of the sequence) / total sequences
A sequence whose loss mask is all zero counts in no denominator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.core.errors import TrainerError
from miles.core.schema.trainer import Aggregation


@dataclass
class Denominators:
    tokens: float  # loss tokens in the global mini-batch
    seqs: float  # sequences with at least one loss token in the global mini-batch


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    seq: torch.Tensor,
    num_seqs: int,
    mode: Aggregation,
    denom: Denominators,
) -> torch.Tensor:
    if values.shape != mask.shape:
        raise TrainerError(f"aggregate: values {tuple(values.shape)} != mask {tuple(mask.shape)}")
    m = mask.to(values.dtype)
    if mode == "token_mean":
        return (values * m).sum() / max(denom.tokens, 1.0)
    sums = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(
        0, seq, values * m
    )
    if mode == "seq_mean_token_mean":
        cnt = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(0, seq, m)
        sums = sums / cnt.clamp(min=1.0)
    return sums.sum() / max(denom.seqs, 1.0)


def local_denominators(mask: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[tokens, seqs with a loss token] of one micro-batch, to be summed over all of them."""
    m = (mask > 0).to(torch.float64)
    per_seq = torch.zeros(num_seqs, dtype=torch.float64, device=mask.device).index_add(0, seq, m)
    return torch.stack([m.sum(), (per_seq > 0).to(torch.float64).sum()])
