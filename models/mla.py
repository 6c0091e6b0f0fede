"""Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi K2).

Keys and values of every head are rebuilt from one per-token latent: `kv_a_proj_with_mqa`
gives a `kv_lora_rank` latent (RMS-normed) plus a `qk_rope_head_dim` key part shared by all
heads that carries the rotary position; `kv_b_proj` expands the latent to each head's
non-rotary key and its value. Queries come from `q_proj`, or through the `q_a_proj` ->
`q_a_layernorm` -> `q_b_proj` bottleneck when `q_lora_rank` is set.

The KV cache holds only the latent and the rotated shared key (`ModelSpec.kv_cache_dims`):
`kv_cache.update(layer, latent, k_rope)` with latent [B, 1, T, kv_lora_rank] and k_rope
[B, 1, T, qk_rope_head_dim], and the full K/V are expanded from the cached latent at each
step (576 values per token and layer for DeepSeek-V3 instead of 128 x (192 + 128)).
Parameter names equal the Hugging Face names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles.models.config import ModelSpec
from miles.models.layers import KVCache, RMSNorm, rms_norm
from miles.models.masked_sdpa import masked_sdpa
from miles.models.rope import apply_rotary_interleaved, apply_rotary_thd

# transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm default eps, not
# the config's rms_norm_eps; so do we, to match checkpoints numerically.
_LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        mla = spec.mla
        assert mla is not None
        self.layer = layer
        self.nh, self.mla = spec.num_heads, mla
        h, qk, bias = spec.hidden_size, mla.qk_head_dim, bool(spec.hf_config.get("attention_bias", False))
        if mla.q_lora_rank:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, self.nh * qk, bias=False)
        else:
            self.q_proj = nn.Linear(h, self.nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, self.nh * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.nh * mla.v_head_dim, h, bias=bias)
        self.scale = spec.rope_spec.softmax_scale(qk)
        self.rotate = apply_rotary_interleaved if mla.rope_interleave else apply_rotary_thd

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.mla.q_lora_rank:
            n = self.q_a_layernorm
            qa = rms_norm(F.linear(x, self.q_a_proj.weight, self.q_a_proj.bias), n.weight, n.eps)
            return F.linear(qa, self.q_b_proj.weight)
        return F.linear(x, self.q_proj.weight)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bias: torch.Tensor | None,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        """x: [B, T, H]; cos, sin: [B, T, 1, qk_rope_head_dim]; bias: [B, 1, T, S] additive (groups=1)."""
        b, t, _ = x.shape
        m, nh = self.mla, self.nh
        q = self._queries(x).view(b, t, nh, m.qk_head_dim)
        q_pass, q_rot = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        ckv = F.linear(x, self.kv_a_proj_with_mqa.weight, self.kv_a_proj_with_mqa.bias)
        latent, k_rot = ckv.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps)
        q = torch.cat((q_pass, self.rotate(q_rot, cos, sin)), dim=-1).transpose(1, 2)  # [B, nh, T, qk]
        k_rot = self.rotate(k_rot.unsqueeze(2), cos, sin).transpose(1, 2)  # [B, 1, T, rope]
        latent = latent.unsqueeze(1)  # [B, 1, T, kv_lora_rank]
        if kv_cache is not None:
            latent, k_rot = kv_cache.update(self.layer, latent, k_rot)
        s = latent.shape[2]
        kv = F.linear(latent.squeeze(1), self.kv_b_proj.weight).view(b, s, nh, -1).transpose(1, 2)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rot.expand(b, nh, s, m.qk_rope_head_dim)), dim=-1)
        if bias is None:
            if kv_cache is not None and t > 1:
                raise ValueError("attention over a KV cache with several new tokens needs an explicit mask")
            out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, scale=self.scale)
        else:
            out = masked_sdpa(q, k, v, bias, self.scale)
        out = out.transpose(1, 2).reshape(b, t, nh * m.v_head_dim)
        return F.linear(out, self.o_proj.weight, self.o_proj.bias)
