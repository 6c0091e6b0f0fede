"""The Qwen2.5-VL-style vision tower: patch embedding, 2-D rotary, window attention, patch merger.

Input is what `core/images.py` `patchify` (or the HF image processor) produces: `pixels` [N, C*tp*p*p],
one row per patch (a 3-D patch over `temporal_patch_size` frames), patches ordered frame by
frame, then merge block by merge block (the `spatial_merge_size`^2 patches of one LM token
consecutive), with each image's (t, h, w) patch grid in `grid` [n, 3]. Output: one feature
row per LM image token, [sum(t*h*w / merge^2), out_hidden_size], in the same order.

Each image runs through the tower on its own, so an image's features do not depend on which
other images share the call (the engine encodes a request's images, the trainer a pack's:
both get the same rows). Blocks at `fullatt_blocks` attend within a frame; the others within
windows of `window_units`^2 merged units; tokens are reordered window by window (as the
reference does) and restored after the merger.

Parameter names follow the checkpoint (`visual.patch_embed.proj.weight` [D, C, tp, p, p],
`visual.blocks.i.attn.qkv`, `...mlp.gate_up_proj` = HF gate_proj | up_proj rows, `visual.merger.ln_q`,
`visual.merger.mlp.0` / `.2`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles.models.errors import ModelInputError
from miles.models.layers import MLP, RMSNorm
from miles.models.masked_sdpa import masked_sdpa
from miles.models.rope import apply_rotary_thd
from miles.models.vl_config import VisionSpec

_EPS = 1e-6  # the reference tower's RMSNorm eps (fixed, not in the config)


class PatchEmbed(nn.Module):
    """A Conv3d with kernel = stride = (tp, p, p) and no bias over one patch is a linear map of
    the flattened patch; it runs as one (the weight keeps the checkpoint's 5-D shape)."""

    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        k = (v.temporal_patch_size, v.patch_size, v.patch_size)
        self.proj = nn.Conv3d(v.in_channels, v.hidden_size, kernel_size=k, stride=k, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1))


class VisionAttention(nn.Module):
    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        self.heads, self.hd = v.num_heads, v.head_dim
        self.qkv = nn.Linear(v.hidden_size, 3 * v.hidden_size, bias=True)
        self.proj = nn.Linear(v.hidden_size, v.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x [N, D]; cos, sin [N, 1, hd] fp32 (signed sin, `rotary_tables` layout); mask [N, N]
        bool (True = may attend) or None (all tokens attend to all)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.hd).unbind(1)
        # rotation in fp32, as the reference does for the tower
        q = apply_rotary_thd(q.float(), cos, sin).to(x.dtype)
        k = apply_rotary_thd(k.float(), cos, sin).to(x.dtype)
        # [1, heads, N, hd]: the 4-D layout every attention kernel (and the batch-invariant one) takes
        q, k, v = (x_.transpose(0, 1).unsqueeze(0) for x_ in (q, k, v))
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, scale=self.hd**-0.5)
        else:
            out = masked_sdpa(q, k, v, mask[None, None], self.hd**-0.5)
        return self.proj(out[0].transpose(0, 1).reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        self.norm1 = RMSNorm(v.hidden_size, _EPS)
        self.norm2 = RMSNorm(v.hidden_size, _EPS)
        self.attn = VisionAttention(v)
        self.mlp = MLP(v.hidden_size, v.intermediate_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm, then the merge_unit patches of one LM token concatenated -> Linear, GELU, Linear."""

    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        wide = v.hidden_size * v.merge_unit
        self.ln_q = RMSNorm(v.hidden_size, _EPS)
        self.mlp = nn.Sequential(nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, v.out_hidden_size))
        self.wide = wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.wide))


def patch_hw(t: int, h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every patch of a t x h x w grid, in the tower's input order."""
    by, bx, iy, ix = (torch.arange(s) for s in (h // merge, w // merge, merge, merge))
    rows = (by.view(-1, 1, 1, 1) * merge + iy.view(1, 1, -1, 1)).expand(h // merge, w // merge, merge, merge)
    cols = (bx.view(1, -1, 1, 1) * merge + ix.view(1, 1, 1, -1)).expand(h // merge, w // merge, merge, merge)
    return rows.reshape(-1).repeat(t), cols.reshape(-1).repeat(t)


def window_order(t: int, lh: int, lw: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order of the merged units window by window [t*lh*lw], window id of each unit in that
    order). Windows tile each frame's lh x lw unit grid in `side` x `side` squares (the last
    ones cut short), frame by frame, row-major; units within a window row-major."""
    f = torch.arange(t).view(t, 1, 1)
    y = torch.arange(lh).view(1, lh, 1)
    x = torch.arange(lw).view(1, 1, lw)
    nwy, nwx = -(-lh // side), -(-lw // side)
    win = ((f * nwy + y // side) * nwx + x // side).expand(t, lh, lw).reshape(-1)
    raster = (y * lw + x).expand(t, lh, lw).reshape(-1)
    order = torch.argsort(win * (lh * lw) + raster, stable=True)
    return order, win[order]


class VisionTower(nn.Module):
    inv_freq: torch.Tensor  # a non-persistent buffer, registered in __init__

    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        self.spec = v
        self.patch_embed = PatchEmbed(v)
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v.depth))
        self.merger = PatchMerger(v)
        rd = v.head_dim // 2  # each of h and w rotates a quarter of the head's channels (x2 halves)
        inv = 1.0 / (v.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:  # fp32 whatever the model's dtype (as `Rotary`)
            rd = self.spec.head_dim // 2
            inv = 1.0 / (self.spec.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
            self.inv_freq = inv.to(self.inv_freq.device)
        return self

    def tokens_of(self, grid: torch.Tensor) -> list[int]:
        """LM image tokens per image of `grid` [n, 3]."""
        return [int(t) * int(h) * int(w) // self.spec.merge_unit for t, h, w in grid.tolist()]

    def forward(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        v = self.spec
        if grid.dim() != 2 or grid.shape[-1] != 3:
            raise ModelInputError(f"image grid must be [n, 3] (t, h, w per image), got shape {tuple(grid.shape)}")
        if pixels.dim() != 2 or pixels.shape[1] != v.patch_dim:
            raise ModelInputError(f"pixels must be [patches, {v.patch_dim}] (C*tp*p*p), got {tuple(pixels.shape)}")
        sizes = [int(t) * int(h) * int(w) for t, h, w in grid.tolist()]
        if sum(sizes) != pixels.shape[0]:
            raise ModelInputError(f"image grids {grid.tolist()} hold {sum(sizes)} patches, pixels have {pixels.shape[0]}")
        outs, at = [], 0
        for (t, h, w), n in zip(grid.tolist(), sizes, strict=True):
            if h % v.spatial_merge_size or w % v.spatial_merge_size:
                raise ModelInputError(f"image grid {t}x{h}x{w}: h and w must be multiples of spatial_merge_size="
                                      f"{v.spatial_merge_size}")
            outs.append(self._one(pixels[at: at + n], int(t), int(h), int(w)))
            at += n
        return torch.cat(outs) if outs else pixels.new_zeros(0, v.out_hidden_size)

    def _one(self, pixels: torch.Tensor, t: int, h: int, w: int) -> torch.Tensor:
        v, m = self.spec, self.spec.spatial_merge_size
        unit = v.merge_unit
        dev = pixels.device
        x = self.patch_embed(pixels)
        rows, cols = patch_hw(t, h, w, m)
        inv = self.inv_freq.to(dev)
        f = torch.cat((rows.to(dev)[:, None].float() * inv, cols.to(dev)[:, None].float() * inv), dim=-1)
        emb = torch.cat((f, f), dim=-1)  # [N, hd]
        half = emb.shape[-1] // 2
        cos, sin = emb.cos(), emb.sin()
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # signed, for apply_rotary_thd
        order, win = window_order(t, h // m, w // m, v.window_units)
        tok = (order.view(-1, 1) * unit + torch.arange(unit)).reshape(-1).to(dev)
        x, cos, sin = x[tok], cos[tok].unsqueeze(1), sin[tok].unsqueeze(1)
        win_tok = win.repeat_interleave(unit).to(dev)
        frame_tok = (order // ((h // m) * (w // m))).repeat_interleave(unit).to(dev)
        win_mask = win_tok[:, None] == win_tok[None, :]
        frame_mask = None if t == 1 else frame_tok[:, None] == frame_tok[None, :]
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, frame_mask if i in v.fullatt_blocks else win_mask)
        merged = self.merger(x)
        return merged[torch.argsort(order).to(dev)]
