"""gpt-oss: attention with learned sinks (plus alternating sliding windows, handled by the
decoder's masks) and a MoE whose experts carry biases and a clamped SwiGLU.

Attention sinks: each head has a logit `sinks[h]` that joins the softmax denominator and
contributes no value. Computed with the ordinary attention kernel by appending one key and
value of zeros after the real keys, whose additive mask entry is the head's sink logit
(q . 0 = 0, so its score is exactly the sink).

MoE: router = linear with bias; top-k of its logits, softmax over those k (R3 replay
gathers the live logits at the given ids, then the same softmax). Experts in the HF layout
(`gate_up_proj` [E, H, 2I] with gate/up interleaved on the last axis, `down_proj` [E, I, H],
biases `*_bias`), activation (up + 1) * gate * sigmoid(alpha * gate) with gate clamped to
<= limit and up to [-limit, limit]. The per-token sum over its k experts runs in slot order,
elementwise, so the result does not depend on the other tokens (batch-invariant as is).
Parameter names equal the Hugging Face names (bf16/fp32 checkpoints; MXFP4 ones are refused).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles.models.config import ModelSpec
from miles.models.layers import Attention, KVCache, grouped_bias, rms_norm
from miles.models.masked_sdpa import masked_sdpa
from miles.models.moe import slot_ordered_experts
from miles.models.rope import apply_rotary_thd
from miles.models.varlen import PackedSeqs


class SinkAttention(Attention):
    """GQA attention (fused q/k/v, biases) with one learned sink logit per head."""

    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__(spec, layer)
        self.sinks = nn.Parameter(torch.zeros(spec.num_heads))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bias: torch.Tensor | PackedSeqs | None,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        # CausalLM passes packed rows only when every attention is the base `Attention` (`_varlen`)
        assert not isinstance(bias, PackedSeqs), "gpt-oss attention takes a mask, not packed rows"
        b, t, _ = x.shape
        nh, nkv, hd, g = self.nh, self.nkv, self.hd, self.groups
        qkv = F.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        qk = qkv[..., : (nh + nkv) * hd].view(b, t, nh + nkv, hd)
        v = qkv[..., (nh + nkv) * hd :].view(b, t, nkv, hd).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            w = torch.cat((self.q_norm.weight.expand(nh, hd), self.k_norm.weight.expand(nkv, hd)))
            qk = rms_norm(qk, w, self.q_norm.eps)
        qk = apply_rotary_thd(qk, cos, sin).transpose(1, 2)
        q, k = qk[:, :nh], qk[:, nh:]
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, k, v)
        s = k.shape[2]
        if bias is None:  # plain causal (no cache), or one new token that sees every cached key
            mask = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(s - t)[None, None]
            bias = grouped_bias(mask, g, q.dtype)
        zeros = k.new_zeros(b, nkv, 1, hd)
        k, v = torch.cat((k, zeros), dim=2), torch.cat((v, zeros), dim=2)
        # sink column: query row (j*T + i) of KV head n belongs to head n*groups + j
        sink = self.sinks.to(q.dtype).view(nkv, g, 1).expand(nkv, g, t).reshape(1, nkv, g * t, 1)
        full = torch.cat((bias.expand(b, nkv, g * t, s), sink.expand(b, nkv, g * t, 1)), dim=-1)
        qg = q.reshape(b, nkv, g * t, hd)
        out = masked_sdpa(qg, k, v, full, hd**-0.5)
        out = out.reshape(b, nh, t, hd).transpose(1, 2).reshape(b, t, nh * hd)
        return F.linear(out, self.o_proj.weight, self.o_proj.bias)


class BiasedExperts(nn.Module):
    """E experts in the HF gpt-oss layout: gate_up_proj [E, H, 2I] (gate even, up odd
    columns), gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H]."""

    def __init__(self, num: int, hidden: int, inter: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(num, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.zeros(num, hidden))
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [N, H]; ids, weights: [N, k] -> [N, H]."""
        if ids.shape[0] == 0:
            return torch.zeros_like(x)

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            gu = rows @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            gate = gu[..., ::2].clamp(max=self.limit)
            up = gu[..., 1::2].clamp(min=-self.limit, max=self.limit)
            act = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
            return act @ self.down_proj[e] + self.down_proj_bias[e]

        return slot_ordered_experts(x, ids, weights, self.gate_up_proj.shape[0], expert)


class TopkSoftmaxMoE(nn.Module):
    """gpt-oss MoE block: `router` (HF name; `gate` aliases it for the trainer's router probe)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_experts, self.top_k = spec.num_experts, spec.num_experts_per_tok
        self.router = nn.Linear(spec.hidden_size, spec.num_experts, bias=True)
        cfg = spec.hf_config
        self.experts = BiasedExperts(
            spec.num_experts, spec.hidden_size, spec.moe_intermediate_size,
            float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0)),
        )

    @property
    def gate(self) -> nn.Linear:
        return self.router

    def forward(
        self, x: torch.Tensor, given_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, H]; given_ids: [B, T, k] or None -> (out [B, T, H], ids [B, T, k] int64)."""
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        logits = self.router(flat)
        if given_ids is None:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
        else:
            ids = given_ids.reshape(-1, self.top_k).to(device=x.device, dtype=torch.long)
            top = logits.gather(-1, ids)
        weights = torch.softmax(top, dim=-1, dtype=top.dtype)
        out = self.experts(flat, ids, weights)
        return out.unflatten(0, (b, t)).clone(), ids.unflatten(0, (b, t)).clone()
