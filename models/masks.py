"""Attention masks for the three layouts the model is run in (bool, True = may attend).

- packed: B=1, several sequences concatenated, given by `cu_seqlens` (trainer);
- padded: B rows right- or left-padded, given by a [B, T] 0/1 validity mask;
- cached: T new tokens per row appended after `past_lens[b]` cached ones (engine).
All return shape [B, 1, T, S] for `F.scaled_dot_product_attention`.
"""

from __future__ import annotations

import torch

from miles.models.errors import ModelInputError


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> None:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ModelInputError(f"cu_seqlens must be 1-D with >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total:
        raise ModelInputError(
            f"cu_seqlens must start at 0 and end at the packed length {total}, got {cu_seqlens.tolist()}"
        )
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ModelInputError(f"cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")


def packed_segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] segment index of every packed token."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)
    return torch.repeat_interleave(torch.arange(lens.numel(), device=cu_seqlens.device), lens, output_size=total)


def packed_position_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[1, total] positions restarting at 0 for every packed sequence."""
    check_cu_seqlens(cu_seqlens, total)
    seg = packed_segment_ids(cu_seqlens, total)
    pos = torch.arange(total, device=cu_seqlens.device) - cu_seqlens[:-1].to(torch.long)[seg]
    return pos.unsqueeze(0)


def packed_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[1, 1, total, total]: block-diagonal (one block per sequence) and causal."""
    check_cu_seqlens(cu_seqlens, total)
    seg = packed_segment_ids(cu_seqlens, total)
    idx = torch.arange(total, device=cu_seqlens.device)
    mask = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    return mask[None, None]


def padded_causal_mask(valid: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] from a [B, T] validity mask; pad queries see themselves so no row is empty."""
    b, t = valid.shape
    v = valid.to(torch.bool)
    idx = torch.arange(t, device=valid.device)
    causal = idx[None, :] <= idx[:, None]
    mask = causal[None] & v[:, None, :]
    mask = mask | torch.eye(t, dtype=torch.bool, device=valid.device)[None]
    return mask[:, None]


def cached_causal_mask(past_lens: torch.Tensor, new_len: int, total: int) -> torch.Tensor:
    """[B, 1, new_len, total]: query i of row b sees keys 0 .. past_lens[b] + i."""
    q = torch.arange(new_len, device=past_lens.device)
    k = torch.arange(total, device=past_lens.device)
    limit = past_lens.to(torch.long)[:, None] + q[None, :]  # [B, new_len]
    return (k[None, None, :] <= limit[:, :, None])[:, None]


def sliding_window_mask(
    mask: torch.Tensor | None, position_ids: torch.Tensor, cached: bool, window: int
) -> torch.Tensor:
    """[B, 1, T, S]: `mask` (None = plain causal, or with a cache and T=1, every cached key)
    narrowed to keys less than `window` positions behind the query.

    Key positions: without a cache the keys are this forward's tokens (`position_ids`); with
    one, key slot j holds position j (the engine's rows start at slot 0)."""
    b, t = position_ids.shape
    if mask is None:
        if cached:  # T = 1, every row attends to all cached keys: S = its position + 1
            s = int(position_ids.max()) + 1
            mask = torch.ones(b, 1, t, s, dtype=torch.bool, device=position_ids.device)
        else:
            mask = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()[None, None]
    s = mask.shape[-1]
    k_pos = torch.arange(s, device=position_ids.device)[None, :] if cached else position_ids
    near = (position_ids[:, :, None] - k_pos[:, None, :]) < window  # [B, T, S]
    return mask.to(torch.bool) & near[:, None]
