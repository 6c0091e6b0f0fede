"""Attention with an explicit mask, kept off cuDNN's fused backward where that returns NaN.

On Hopper, torch >= 2.11 picks cuDNN's fused attention for `scaled_dot_product_attention` with an
explicit `attn_mask`. Its backward writes NaN into dq when the key length is 64 past a multiple
of 128 and a query row's logsumexp is below ln(FLT_MAX) ~ -88.7: the padded half of the last
128-wide key tile is scored 0 instead of -inf, exp(0 - lse) overflows and meets a zero key
(pytorch/pytorch#196678; the memory-efficient and math kernels are clean on the same inputs).
Qwen2.5 has heads whose every score sits near -100 (its "massive activation" heads), so a packed
2,880-token micro-batch (the masked path: shorter than `VARLEN_AUTO_MIN_TOKENS`) gave every
parameter a NaN gradient from finite inputs in session 16's H100 run, and the same kind of step
killed all three `tis` runs of session 14 before the guard existed.

So a masked call that autograd will differentiate (grad mode on, CUDA) excludes the cuDNN backend;
forward-only calls (the engine's decode and prefill, the trainer's no-grad logprob pass) keep
torch's choice, since the forward is correct.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# every backend but cuDNN; torch picks the first that takes the inputs (with a mask: efficient)
_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def needs_no_cudnn(q: torch.Tensor) -> bool:
    """Whether a masked attention over `q` will run cuDNN's backward if left to torch's choice."""
    return q.is_cuda and torch.is_grad_enabled()


def masked_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)`, off cuDNN where
    its backward would run (see the module docstring)."""
    if needs_no_cudnn(q):
        with sdpa_kernel(_NO_CUDNN):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
