"""Qwen3-Next: a hybrid of Gated DeltaNet (linear attention) layers and gated full attention,
zero-centred RMSNorms, and a high-sparsity MoE with a sigmoid-gated shared expert.

Gated DeltaNet (`linear_attn`): q, k, v pass a causal depthwise convolution (kernel
`linear_conv_kernel_dim`, SiLU), q and k are L2-normed, and a per-head state S [dk, dv]
evolves per token as S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; out = S^T q / sqrt(dk),
with g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b). The output is RMS-normed,
gated by SiLU(z) and projected.

Packed sequences and the engine: the state restarts where a token's position is 0 and the
convolution sees only earlier tokens of the same sequence (position >= shift), so packed
training needs no segment ids. In the engine the KV cache holds, per token, the layer's
pre-convolution inputs (q|k|v, b, a) instead of a recurrent state; each forward re-runs the
convolution and recurrence over the cached history (slot = position) and keeps the outputs
at the new tokens' positions. Prefix reuse, row moves and sessions then work as for
attention layers; a decode step costs O(history) in these layers.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from miles.models.config import ModelSpec
from miles.models.layers import KVCache
from miles.models.masked_sdpa import masked_sdpa
from miles.models.rope import apply_rotary_thd


def zc_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: statistics and the (1 + weight) scale in fp32, cast back."""
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * (1.0 + weight.float())).type_as(x)


class ZcRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zc_rms_norm(x, self.weight, self.eps)


class GatedAttention(nn.Module):
    """Full attention whose q_proj also yields a per-channel output gate (sigmoid)."""

    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.nh, self.nkv, self.hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.groups = self.nh // self.nkv
        h, bias = spec.hidden_size, spec.qkv_bias
        self.q_proj = nn.Linear(h, 2 * self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=bias)
        self.q_norm = ZcRMSNorm(self.hd, spec.rms_norm_eps)
        self.k_norm = ZcRMSNorm(self.hd, spec.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bias: torch.Tensor | None,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        qg = F.linear(x, self.q_proj.weight, self.q_proj.bias).view(b, t, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(b, t, nh * hd)
        q = zc_rms_norm(q, self.q_norm.weight, self.q_norm.eps)
        k = zc_rms_norm(F.linear(x, self.k_proj.weight, self.k_proj.bias).view(b, t, nkv, hd),
                        self.k_norm.weight, self.k_norm.eps)
        v = F.linear(x, self.v_proj.weight, self.v_proj.bias).view(b, t, nkv, hd).transpose(1, 2)
        q = apply_rotary_thd(q, cos, sin).transpose(1, 2)
        k = apply_rotary_thd(k, cos, sin).transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, k, v)
        if bias is None:
            if kv_cache is not None and t > 1:
                raise ValueError("attention over a KV cache with several new tokens needs an explicit mask")
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=t > 1, scale=hd**-0.5, enable_gqa=self.groups > 1
            )
        else:
            out = masked_sdpa(q.reshape(b, nkv, self.groups * t, hd), k, v, bias,
                              hd**-0.5).reshape(b, nh, t, hd)
        out = out.transpose(1, 2).reshape(b, t, nh * hd) * torch.sigmoid(gate)
        return F.linear(out, self.o_proj.weight, self.o_proj.bias)


class GatedDeltaNet(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        d = spec.deltanet
        assert d is not None
        self.layer, self.d = layer, d
        h = spec.hidden_size
        nk, nv, dk, dv = d.num_k_heads, d.num_v_heads, d.k_head_dim, d.v_head_dim
        self.in_proj_qkvz = nn.Linear(h, 2 * nk * dk + 2 * nv * dv, bias=False)
        self.in_proj_ba = nn.Linear(h, 2 * nv, bias=False)
        self.conv1d = nn.Conv1d(d.conv_dim, d.conv_dim, d.conv_kernel, groups=d.conv_dim, bias=False,
                                padding=d.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(nv))
        self.A_log = nn.Parameter(torch.zeros(nv))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(dv))
        self.eps = spec.rms_norm_eps
        self.out_proj = nn.Linear(nv * dv, h, bias=False)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> (history [B, T, conv_dim + 2 nv] = q|k|v, b, a; z [B, T, nv, dv]),
        in the grouped per-key-head layout of the HF projections."""
        d = self.d
        b, t, _ = x.shape
        r = d.num_v_heads // d.num_k_heads
        qkvz = F.linear(x, self.in_proj_qkvz.weight).view(b, t, d.num_k_heads, -1)
        ba = F.linear(x, self.in_proj_ba.weight).view(b, t, d.num_k_heads, 2 * r)
        q, k, v, z = qkvz.split([d.k_head_dim, d.k_head_dim, r * d.v_head_dim, r * d.v_head_dim], dim=-1)
        bb, a = ba[..., :r].reshape(b, t, -1), ba[..., r:].reshape(b, t, -1)
        hist = torch.cat((q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1), bb, a), dim=-1)
        return hist, z.reshape(b, t, d.num_v_heads, d.v_head_dim)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, kv_cache: KVCache | None
    ) -> torch.Tensor:
        """x [B, T, H]; position_ids [B, T] (engine: slot = position) -> [B, T, H]."""
        b, t, _ = x.shape
        d = self.d
        hist, z = self._split(x)
        if kv_cache is None:
            pos = position_ids
        else:
            hist, _ = kv_cache.update(self.layer, hist.unsqueeze(1), hist.new_zeros(b, 1, t, 0))
            hist = hist.squeeze(1)
            pos = torch.arange(hist.shape[1], device=x.device).expand(b, -1)
        s = hist.shape[1]
        mixed, bb, a = hist.split([d.conv_dim, d.num_v_heads, d.num_v_heads], dim=-1)
        mixed = self._conv(mixed, pos)
        nk, nv, dk, dv = d.num_k_heads, d.num_v_heads, d.k_head_dim, d.v_head_dim
        q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = self._recurrence(q.reshape(b, s, nk, dk), k.reshape(b, s, nk, dk), v.reshape(b, s, nv, dv),
                               g, bb.sigmoid(), pos)
        if kv_cache is not None:  # keep the new tokens' outputs
            out = out.gather(1, position_ids[:, :, None, None].expand(b, t, nv, dv))
        out = out.to(x.dtype)
        normed = cast(torch.Tensor, self.norm.weight) * F.rms_norm(out.float(), (dv,), eps=self.eps).to(x.dtype)
        out = (normed * F.silu(z.float())).to(x.dtype)
        return F.linear(out.reshape(b, t, nv * dv), self.out_proj.weight)

    def _conv(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv along T, each token seeing only its own sequence's earlier
        tokens (shift j counts when pos >= j), then SiLU. x [B, S, C]."""
        w = self.conv1d.weight[:, 0]  # [C, K]; tap K-1 is the current token
        kk = w.shape[1]
        out = x * w[:, kk - 1]
        for j in range(1, kk):
            shifted = F.pad(x, (0, 0, j, 0))[:, : x.shape[1]]
            out = out + shifted * w[:, kk - 1 - j] * (pos >= j).unsqueeze(-1).to(x.dtype)
        return F.silu(out)

    def _recurrence(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        pos: torch.Tensor,
    ) -> torch.Tensor:
        """The gated delta rule, token by token in fp32; the state restarts at position 0."""
        b, s, nv, dv = v.shape
        r = nv // q.shape[2]
        q = q.repeat_interleave(r, dim=2).float()
        k = k.repeat_interleave(r, dim=2).float()
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        q = q / q.shape[-1] ** 0.5
        v, beta = v.float(), beta.float()
        state = v.new_zeros(b, nv, k.shape[-1], dv)
        keep = (pos != 0).float()
        outs = []
        for i in range(s):
            decay = (g[:, i].exp() * keep[:, i : i + 1])[..., None, None]
            state = state * decay
            kv_mem = (state * k[:, i, :, :, None]).sum(dim=-2)
            delta = (v[:, i] - kv_mem) * beta[:, i, :, None]
            state = state + k[:, i, :, :, None] * delta[:, :, None, :]
            outs.append((state * q[:, i, :, :, None]).sum(dim=-2))
        return torch.stack(outs, dim=1)  # [B, S, nv, dv]

