"""Packed (varlen) causal attention without a materialised mask.

The trainer packs a micro-batch's sequences into one row (`cu_seqlens`). The masked path
builds a [groups*T, T] additive bias for that row and runs attention over all T x T pairs,
most of them across sequences and masked out: quadratic in the micro-batch's token budget
(a 16k-token pack is a 3 GB bf16 bias per layer call with 6 query groups) and excluded from
the flash kernels, which take no arbitrary mask. Here each sequence is its own causal
`scaled_dot_product_attention` call over its [start, end) slice, which the flash backend
serves on CUDA: work and memory follow the sequences' own lengths. Numerics equal the masked
path up to floating-point summation order (tests/models/test_models_varlen.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles.models.flash_varlen import flash_packed_attention
from miles.models.invariant import invariant_active


@dataclass(frozen=True)
class PackedSeqs:
    """The sequences of a packed row, passed to attention in place of a mask."""

    bounds: tuple[tuple[int, int], ...]  # (start, end) of every non-empty sequence

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor) -> PackedSeqs:
        host = [int(x) for x in cu_seqlens.tolist()]  # one device sync per forward, not per layer
        return cls(tuple((a, b) for a, b in zip(host[:-1], host[1:], strict=True) if b > a))


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSeqs,
                            scale: float) -> torch.Tensor:
    """q [1, heads, T, d], k and v [1, kv_heads, T, d] -> [1, heads, T, d], causal within each sequence.
    On CUDA one flash varlen call over the row where torch has it (models/flash_varlen.py)."""
    # true on-policy: per-sequence SDPA calls, which `BatchInvariant` routes to its exact kernel
    fused = None if invariant_active() else flash_packed_attention(q, k, v, seqs.bounds, scale)
    if fused is not None:
        return fused
    gqa = q.shape[1] != k.shape[1]
    outs = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                           scale=scale, enable_gqa=gqa) for a, b in seqs.bounds]
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
