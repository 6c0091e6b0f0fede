"""Linear layers under the FP8 contract: the trainer's fake-quantized forward and the
engine's FP8 weights, both computing with the same `Ŵ` (models/fp8.py).

- Trainer (float master weights, an `Fp8Plan` attached): the forward uses
  `Ŵ = dequant(quant(W))` in the weight's dtype; the backward passes the gradient straight
  through to W (the straight-through estimator: rounding has no useful derivative).
- Engine (`to_fp8_weights`, models/fp8_model.py): the weight parameter holds the float8_e4m3fn codes and a
  `weight_scale_inv` parameter the fp32 block scales, both synced and swapped like any
  weight. On the CPU, and in batch-invariant mode, the forward dequantizes them into the
  compute dtype: the trainer's Ŵ bit for bit. On CUDA it runs FP8 GEMMs when the shapes
  allow it (models/fp8_gemm.py): with activations rounded to FP8 per token and 128 columns
  (`engine.fp8_gemm`, fast; logprobs then differ from the trainer's by that rounding), or with
  Ŵ rebuilt inside the kernel in the activation dtype (exact weights, half the bytes).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from miles.core.logging import get_logger
from miles.models.fp8 import FP8, SCALE_SUFFIX
from miles.models.fp8_gemm import GEMM_BLOCK, cuda_linear
from miles.models.fp8_layout import (
    Fp8Plan,
    dequantize_rows,
    quantize_rows,
)
from miles.models.invariant import invariant_active

log = get_logger("miles.models.fp8")
PLAN_ATTR = "fp8_plan"  # the attribute of an nn.Linear that holds its Fp8Plan
GEMM_ATTR = "fp8_gemm"  # ... and whether it multiplies in FP8 on CUDA (default True)
_CACHE_ATTR = "_fp8_cache"  # ... and its cached dequantized weight (CPU engine)


class _FakeQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, plan: Fp8Plan) -> torch.Tensor:
        codes, scale = quantize_rows(w, plan)
        return dequantize_rows(codes, scale, plan, w.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def fake_quantized(w: torch.Tensor, plan: Fp8Plan) -> torch.Tensor:
    """Ŵ of a float weight, gradient straight through to `w`."""
    return _FakeQuantSTE.apply(w, plan)


def project(x: torch.Tensor, mod: nn.Linear) -> torch.Tensor:
    """`F.linear(x, mod.weight, mod.bias)` under the module's FP8 plan, if it has one."""
    plan: Fp8Plan | None = getattr(mod, PLAN_ATTR, None)
    w = mod.weight
    if plan is None:
        return F.linear(x, w, mod.bias)
    if w.dtype == FP8:
        scale = getattr(mod, "weight" + SCALE_SUFFIX)
        if x.is_cuda and not invariant_active() and _gemm_ok(x, w, plan):
            lead, k = x.shape[:-1], x.shape[-1]
            y = cuda_linear(x.reshape(-1, k), w, scale, mod.bias, act_fp8=getattr(mod, GEMM_ATTR, True))
            if y is not None:
                return y.view(*lead, w.shape[0])
        w_hat = _cached_dequant(mod, w, scale, plan, x.dtype) if not x.is_cuda else dequantize_rows(
            w, scale, plan, x.dtype)
        return F.linear(x, w_hat, mod.bias)
    return F.linear(x, fake_quantized(w, plan), mod.bias)


_generation = [0]


def weights_changed() -> None:
    """New live weights (an engine commit): drop every cached Ŵ in this process, and every other
    tensor cached from the weights (`weight_generation`)."""
    _generation[0] += 1


def weight_generation() -> int:
    """Bumped by `weights_changed`: part of the key of a tensor cached from live weights, since a
    commit may land bytes without torch's version counters seeing it (writes through `.data`)."""
    return _generation[0]


def _cached_dequant(mod: nn.Module, codes: torch.Tensor, scale: torch.Tensor, plan: Fp8Plan,
                    dtype: torch.dtype) -> torch.Tensor:
    """CPU engine: Ŵ kept until the codes or scales change, so a decode step does not pay a
    dequantization per layer. Keyed by the weight generation (`weights_changed`, called at every
    engine commit: a receiver may write staged bytes without torch noticing) and by storage
    address and version counter of codes and scales (any in-place torch write)."""
    key = (_generation[0], codes.data_ptr(), codes._version, scale.data_ptr(), scale._version, dtype)
    hit: tuple[tuple[Any, ...], torch.Tensor] | None = getattr(mod, _CACHE_ATTR, None)
    if hit is None or hit[0] != key:
        hit = (key, dequantize_rows(codes, scale, plan, dtype))
        setattr(mod, _CACHE_ATTR, hit)
    return hit[1]


def _gemm_ok(x: torch.Tensor, w: torch.Tensor, plan: Fp8Plan) -> bool:
    """Shapes the CUDA FP8 kernels take: 128x128 blocks whose scale grid is one grid over the
    fused rows (every segment whole row blocks), K a multiple of 128, bf16/fp16 activations."""
    return (plan.block == (GEMM_BLOCK, GEMM_BLOCK) and plan.block_aligned and w.shape[1] % GEMM_BLOCK == 0
            and w.shape[0] % 16 == 0 and x.dtype in (torch.bfloat16, torch.float16))
