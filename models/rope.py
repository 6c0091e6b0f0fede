"""Rotary position embedding variants: default, linear, dynamic (NTK), yarn and llama3.

`RopeSpec.from_hf` parses the HF `rope_parameters` (transformers 5) or `rope_scaling`
(transformers 4) dict; anything else is refused naming the key. `RopeSpec.inv_freq`
computes the inverse frequencies the way transformers' `ROPE_INIT_FUNCTIONS` do, op for
op, so the cos/sin tables agree bit for bit in fp32.

`dynamic` rescales the base from the longest position of the forward (`seq_len`): it is a
pure function of that forward here, where transformers also remembers the longest length
seen so far; both agree on any single forward. Because the scaling depends on the batch,
dynamic rope is refused under the batch-invariant mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from miles.core.errors import ConfigError
from miles.models.errors import ModelInputError
from miles.models.invariant import invariant_active

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    """One rotary embedding: `dim` rotated channels (head_dim x partial_rotary_factor)."""

    rope_type: str
    theta: float
    dim: int
    factor: float = 1.0
    max_position_embeddings: int = 0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0  # multiplies cos and sin (yarn)
    mscale_all_dim: float = 0.0  # yarn: DeepSeek's softmax-scale correction (`yarn_softmax_scale`)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], model_type: str, head_dim: int) -> RopeSpec:
        key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
        params = cfg.get(key) or {}
        if not isinstance(params, dict):
            raise ConfigError(f"model config ({model_type}): {key}={params!r} must be a dict")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"model config ({model_type}): {key}.rope_type={rope_type!r} is not supported "
                f"(supported: {', '.join(ROPE_TYPES)})"
            )
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
            raise ConfigError(f"model config ({model_type}): rope_theta={theta!r} must be a positive number")
        default_partial = {"glm4_moe": 0.5, "qwen3_next": 0.25}.get(model_type, 1.0)  # transformers' defaults
        partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default_partial))
        if not isinstance(partial, int | float) or not 0 < partial <= 1:
            raise ConfigError(f"model config ({model_type}): partial_rotary_factor={partial!r} must be in (0, 1]")
        dim = int(head_dim * partial)
        if dim % 2:
            raise ConfigError(f"model config ({model_type}): rotary dim {dim} (head_dim x partial_rotary_factor) must be even")
        max_pos = cfg.get("max_position_embeddings", 32768)
        orig = cfg.get("original_max_position_embeddings", params.get("original_max_position_embeddings", max_pos))

        def num(name: str, default: float | None = None) -> float:
            v = params.get(name, default)
            if v is None or not isinstance(v, int | float) or isinstance(v, bool):
                raise ConfigError(
                    f"model config ({model_type}): {key}.{name}={v!r} must be a number for rope_type={rope_type!r}"
                )
            return float(v)

        spec: dict[str, Any] = dict(
            rope_type=rope_type, theta=float(theta), dim=dim, max_position_embeddings=int(max_pos),
            original_max_position_embeddings=int(orig),
        )
        if rope_type in ("linear", "dynamic", "llama3"):
            spec["factor"] = num("factor")
        if rope_type == "llama3":
            spec.update(low_freq_factor=num("low_freq_factor"), high_freq_factor=num("high_freq_factor"))
        if rope_type == "yarn":
            factor = params.get("factor")
            spec["factor"] = float(max_pos / orig) if factor is None else num("factor")
            spec.update(
                beta_fast=float(params.get("beta_fast") or 32),
                beta_slow=float(params.get("beta_slow") or 1),
                truncate=bool(params.get("truncate", True)),
                mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
            )
            spec["attention_factor"] = _yarn_attention_factor(params, spec["factor"])
        return cls(**spec)

    def inv_freq(self, seq_len: int | None = None) -> torch.Tensor:
        """fp32 inverse frequencies [dim // 2] (on the CPU); `seq_len` matters for dynamic only."""
        dim = self.dim
        base: float | torch.Tensor = self.theta
        exps = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
        if self.rope_type == "dynamic" and seq_len is not None and seq_len > self.max_position_embeddings:
            # as transformers does for a forward past max_position_embeddings: a 0-d fp32 tensor
            n, f, m = torch.tensor(seq_len), self.factor, self.max_position_embeddings
            base = base * ((f * n / m) - (f - 1)) ** (dim / (dim - 2))
        if self.rope_type == "yarn":
            return self._yarn()
        inv = 1.0 / (base**exps)
        if self.rope_type == "linear":
            inv = inv / self.factor
        if self.rope_type == "llama3":
            inv = self._llama3(inv)
        return inv

    def needs_seq_len(self, seq_len: int) -> bool:
        """Whether a forward reaching `seq_len` positions needs rescaled frequencies."""
        return self.rope_type == "dynamic" and seq_len > self.max_position_embeddings

    def _llama3(self, inv: torch.Tensor) -> torch.Tensor:
        old = self.original_max_position_embeddings
        lo, hi, f = self.low_freq_factor, self.high_freq_factor, self.factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / f + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)

    def _yarn(self) -> torch.Tensor:
        dim, base, f = self.dim, self.theta, self.factor
        old = self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # no zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        extrapolation = 1 - ramp
        return (1.0 / (f * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation

    def softmax_scale(self, qk_head_dim: int) -> float:
        """DeepSeek-style attention scale: head_dim^-0.5, times mscale^2 under yarn with mscale_all_dim."""
        scale = qk_head_dim**-0.5
        if self.rope_type != "default" and self.mscale_all_dim:
            m = _mscale(self.factor, self.mscale_all_dim)
            scale = scale * m * m
        return scale


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    given = params.get("attention_factor")
    if given is not None:
        return float(given)
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and all_dim:
        return float(_mscale(factor, mscale) / _mscale(factor, all_dim))
    return _mscale(factor)


class Rotary(nn.Module):
    """Returns (cos, sin) of shape [B, T, rope.dim] for given position ids.

    The frequencies stay fp32 whatever dtype the model is cast to (`model.to(bf16)` would
    otherwise round them): a bf16 engine built by `.to(bfloat16)` and a bf16 trainer whose
    mixed precision casts only parameters must compute the same tables (true on-policy).
    """

    inv_freq: torch.Tensor  # a non-persistent buffer, registered in __init__

    def __init__(self, rope: RopeSpec) -> None:
        super().__init__()
        self.rope = rope
        self.register_buffer("inv_freq", rope.inv_freq(), persistent=False)
        # `lookup`'s tables: (inv_freq they came from, dtype, cos, signed sin [n, 1, d])
        self._table: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:  # recomputed, not cast back: bits were lost
            # computed on the CPU on both sides, then moved: device pow kernels may round differently
            self.inv_freq = self.rope.inv_freq().to(self.inv_freq.device)
        self._table = None
        return self

    def lookup(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`rotary_tables(*self(position_ids, dtype))` read from tables of positions 0..n-1 built
        once by the same per-element ops (grown to the next power of two as positions rise): two
        lookups instead of ~10 small ops per forward, a visible share of an eager CPU decode step
        of a small model. Host-side bound check: for the CPU engine, not for traced / captured
        forwards; not for rope_type 'dynamic', whose frequencies depend on the batch."""
        if not position_ids.numel():
            return rotary_tables(*self(position_ids, dtype))
        lo, hi = (int(v) for v in torch.aminmax(position_ids))
        if lo < 0:  # a negative index would read the table from its end
            return rotary_tables(*self(position_ids, dtype))
        n = hi + 1
        t = self._table
        if t is None or t[0] is not self.inv_freq or t[1] != dtype or t[2].shape[0] < n:
            size = max(256, 1 << (n - 1).bit_length())
            pos = torch.arange(size, device=position_ids.device)[None]
            cos, sin = rotary_tables(*self(pos, dtype))
            t = self._table = (self.inv_freq, dtype, cos[0], sin[0])
        return t[2][position_ids], t[3][position_ids]

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq
        if self.rope.rope_type == "dynamic":
            inv = self._dynamic(position_ids, inv)
        freqs = position_ids[..., None].float() * inv.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.rope.attention_factor != 1.0:
            cos, sin = cos * self.rope.attention_factor, sin * self.rope.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def _dynamic(self, position_ids: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        if invariant_active():
            raise ModelInputError(
                "rope_type='dynamic' rescales frequencies from the longest position in the batch, "
                "so it cannot run batch-invariant (true on-policy); use a fixed rope type"
            )
        if position_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ModelInputError("rope_type='dynamic' reads the batch's longest position on the host: "
                                  "run the engine with engine.cuda_graphs=false")
        n = int(position_ids.max()) + 1 if position_ids.numel() else 0
        return self.rope.inv_freq(n) if self.rope.needs_seq_len(n) else inv


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) [B, T, 1, d] for `apply_rotary_thd` on [B, T, heads, d] tensors;
    built once per forward and shared by every layer."""
    half = cos.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos.unsqueeze(2), signed.unsqueeze(2)


def apply_rotary_thd(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [B, T, heads, d] with tables from `rotary_tables` (rotate-half layout); when
    x has more channels than the tables (partial rotary), the rest pass through unrotated.
    rotate_half(x) * sin == roll(x, half) * signed_sin bit for bit (only signs move)."""
    d = cos.shape[-1]
    if x.shape[-1] != d:
        return torch.cat((apply_rotary_thd(x[..., :d], cos, signed_sin), x[..., d:]), dim=-1)
    return x * cos + x.roll(d // 2, dims=-1) * signed_sin


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved RoPE ((x0, x1), (x2, x3), ... pairs) on x [B, T, heads, d]; the
    result is laid out de-interleaved (rotated evens, then rotated odds), as in transformers:
    q and k get the same permutation, so their dot products are unchanged."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], signed_sin[..., half:]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
