"""Building blocks of the decoder: RMSNorm, attention (with a KV cache hook), MLP (rotary: `rope`).

Numerics follow the Hugging Face implementations op for op (fp32 RMSNorm
statistics, fp32 rotary tables cast to the activation dtype) so that logits agree
with transformers to ~1e-6 in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module

from miles.models.config import ModelSpec
from miles.models.fp8_linear import PLAN_ATTR, project, weight_generation
from miles.models.masked_sdpa import masked_sdpa
from miles.models.rope import apply_rotary_thd
from miles.models.varlen import PackedSeqs, packed_causal_attention


class KVCache(Protocol):
    """What attention needs from a KV cache: append this step's keys/values, get all of them.

    `update(layer, k, v)` receives k, v of shape [B, kv_heads, T_new, head_dim] (already
    rotated) and returns the full keys/values [B, kv_heads, S, head_dim] the queries of
    this step attend over; the caller's attention mask must be [B, 1, T_new, S].
    """

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def eager_cpu_step(x: torch.Tensor) -> bool:
    """Whether `x` flows through an eager CPU forward without autograd, not traced by torch.compile:
    the CPU engine's steps. A small model's decode step there is ~170 ops of a few microseconds
    each, so the op count and Python's per-call overhead, not FLOPs, set its time."""
    # is_cpu, not device.type: the device object costs microseconds in a hot loop
    return x.is_cpu and not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def no_global_hooks() -> bool:
    """No global module hooks and no JIT trace: `plain_forward` may skip `nn.Module.__call__`
    (checked once per forward, not per module)."""
    return not nn_module._has_any_global_hook() and torch._C._get_tracing_state() is None


def plain_forward(m: nn.Module) -> Callable[..., Any]:
    """What calling `m` runs when it has no hooks of its own (and `no_global_hooks`): its
    `forward`, without `nn.Module.__call__`'s two extra Python frames (~3 us a call in a hot
    loop; an eager CPU decode step calls ~14 modules). `m` itself when one of its hooks could fire."""
    if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
        return m
    return m.forward


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: statistics in fp32, then cast back and scale. `weight` broadcasts over the
    trailing axes of x (shape [D] or e.g. [heads, D] for per-head norms of a fused q|k)."""
    d = x.shape[-1]
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        if eager_cpu_step(x):
            # F.rms_norm's own CPU ops (pow, mean, add eps, rsqrt, two products), called directly:
            # bit-identical, in 6 ops where F.rms_norm dispatches ~12 (two of them copies); it is
            # 13 calls of a decode step. Without autograd only: its backward is F.rms_norm's own.
            return (x * x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()).mul_(weight)
        if weight.dim() == 1:
            # the same ops as below, with the scaling inside the one F.rms_norm call (bit-identical)
            return F.rms_norm(x, (d,), weight, eps=eps)
    return weight * F.rms_norm(x.float(), (d,), eps=eps).to(x.dtype)


def linear(fan_in: int, fan_out: int, bias: bool) -> nn.Linear:
    """An nn.Linear with `fp8_plan = None` (models/fp8_model.py sets a plan there): `project`'s
    per-call lookup of the plan then finds it in the instance dict instead of falling through
    to `Module.__getattr__`, which raises and catches an AttributeError each time (a few us;
    16 lookups in an eager CPU decode step of a small model)."""
    lin = nn.Linear(fan_in, fan_out, bias=bias)
    setattr(lin, PLAN_ATTR, None)
    return lin


def grouped_bias(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask [B, 1, T, S] -> additive float mask [B, 1, groups*T, S] for grouped queries."""
    bias = torch.where(mask, 0.0, torch.finfo(dtype).min).to(dtype)
    return bias.repeat(1, 1, groups, 1) if groups > 1 else bias


class Attention(nn.Module):
    """Self-attention; q/k/v share one fused projection (HF q_proj/k_proj/v_proj are row slices).

    Grouped-query attention folds the query heads of one KV head into the query
    axis ([B, kv_heads, groups*T, hd]), so keys/values are never repeated; the mask
    passed in must therefore come from `grouped_bias` (or be None for plain causal).
    """

    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.nh, self.nkv, self.hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.groups = self.nh // self.nkv
        h = spec.hidden_size
        self.qkv_proj = linear(h, (self.nh + 2 * self.nkv) * self.hd, bias=spec.qkv_bias)
        self.o_proj = linear(self.nh * self.hd, h, bias=spec.o_bias)
        self.q_norm = RMSNorm(self.hd, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.hd, spec.rms_norm_eps) if spec.qk_norm else None
        self._qk_w: tuple[tuple[int, ...], torch.Tensor] | None = None  # `_qk_norm_weight`'s last result

    def _qk_norm_weight(self) -> torch.Tensor:
        """The q and k norm weights, one row per head ([nh + nkv, hd]). On the CPU in inference
        (the CPU engine's eager steps, which would rebuild it in every layer: three small ops)
        built once per weight version, keyed by the engine's commits (`weight_generation`: a
        commit writes through `.data`, which torch's version counters do not see) and by the
        weights' storage and version counters (any other in-place torch write).
        Elsewhere built per call: a training gradient flows through it, and a captured or
        compiled decode must read the live weights, not a tensor the cache may replace."""
        assert self.q_norm is not None and self.k_norm is not None
        qw, kw = self.q_norm.weight, self.k_norm.weight
        if torch.compiler.is_compiling() or not qw.is_cpu or not torch.is_inference_mode_enabled():
            return torch.cat((qw.expand(self.nh, self.hd), kw.expand(self.nkv, self.hd)))
        key = (weight_generation(), qw.data_ptr(), qw._version, kw.data_ptr(), kw._version)
        if self._qk_w is None or self._qk_w[0] != key:
            self._qk_w = (key, torch.cat((qw.expand(self.nh, self.hd), kw.expand(self.nkv, self.hd))))
        return self._qk_w[1]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bias: torch.Tensor | PackedSeqs | None,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        """x: [B, T, H]; cos, sin: [B, T, 1, rd] from `rotary_tables` (rd < hd: partial rotary,
        the first rd channels of each head rotate); bias from `grouped_bias`, or the sequences
        of a packed row (`PackedSeqs`, B = 1, no cache)."""
        b, t, _ = x.shape
        # projections through F.linear (`project`: under the FP8 contract when it applies), not
        # the submodules' __call__: per-call module overhead is a large share of a small decode step
        qkv = project(x, self.qkv_proj)
        nh, nkv, hd = self.nh, self.nkv, self.hd
        # q and k heads side by side: one norm call and one rotary call cover both
        qk, v = qkv.split_with_sizes(((nh + nkv) * hd, nkv * hd), dim=-1)  # not .split: a Python wrapper
        qk = qk.view(b, t, nh + nkv, hd)
        v = v.view(b, t, nkv, hd).transpose(1, 2)
        if self.q_norm is not None:
            qk = rms_norm(qk, self._qk_norm_weight(), self.q_norm.eps)
        q, k = apply_rotary_thd(qk, cos, sin).transpose(1, 2).split_with_sizes((nh, nkv), dim=1)
        if isinstance(bias, PackedSeqs):  # packed training row: no mask (models/varlen.py)
            out = packed_causal_attention(q, k, v, bias, self.hd**-0.5)
            return project(out.transpose(1, 2).reshape(b, t, self.nh * self.hd), self.o_proj)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, k, v)
        if bias is None:
            if kv_cache is not None and t > 1:
                raise ValueError("attention over a KV cache with several new tokens needs an explicit mask")
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=t > 1, scale=self.hd**-0.5, enable_gqa=self.groups > 1
            )
        else:
            qg = q.reshape(b, self.nkv, self.groups * t, self.hd)
            out = masked_sdpa(qg, k, v, bias, self.hd**-0.5)
            # reshape, not view: CUDA kernels return [B, T, H, d]-major outputs (non-contiguous)
            out = out.reshape(b, self.nh, t, self.hd)
        out = out.transpose(1, 2).reshape(b, t, self.nh * self.hd)
        return project(out, self.o_proj)


class MLP(nn.Module):
    """SwiGLU feed-forward; gate and up share one fused projection (HF gate_proj/up_proj row slices)."""

    def __init__(self, hidden: int, inter: int, bias: bool = False) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_proj = linear(hidden, 2 * inter, bias=bias)
        self.down_proj = linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.gate_up_proj).chunk(2, dim=-1)
        act = F.silu(gate)
        # in place without autograd (the engine): silu's fresh output takes the product
        act = act * up if torch.is_grad_enabled() else act.mul_(up)
        return project(act, self.down_proj)
