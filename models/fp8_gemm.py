"""FP8 GEMMs on CUDA for the contract's linear layers: which kernel runs, with which layouts.

Kernels (`KINDS`), for `y = x @ Ŵ.T`, `Ŵ` the contract's weights (128x128 blocks):

- `triton_a8`: activations quantized per token and 128 columns inside the GEMM, FP8 tensor
  cores (models/fp8_triton.py); one kernel per projection.
- `cublas_a8`: the same math through `F.scaled_mm` (cuBLAS blockwise 1x128 x 128x128 scaling),
  activations quantized by a separate kernel first (one Triton kernel where triton exists).
- `triton_a16`: `Ŵ` rebuilt in registers in the activation dtype, bf16/fp16 tensor cores:
  the trainer's weight values exactly (activations not rounded), half the weight bytes.

`engine.fp8_gemm = true` runs the faster of `cublas_a8` and `triton_a8` for each shape (timed on
first use); false runs `triton_a16`; where none applies (no triton, no sm90 kernels, shapes) the
caller computes with the dequantized weights.
A kernel that raises, or whose first result per shape disagrees with the dequantized reference,
is logged once (`fp8_gemm_unavailable`) and not used again in this process.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F

from miles.core.logging import get_logger
from miles.models.fp8 import E4M3_MAX, FP8, dequantize_blockwise
from miles.models.graph_timing import graph_time

log = get_logger("miles.models.fp8")
GEMM_BLOCK = 128  # cuBLAS's and the Triton kernel's block: 1x128 activations, 128x128 weights
KINDS = ("triton_a8", "cublas_a8", "triton_a16")
HAS_SCALED_MM = hasattr(F, "scaled_mm")  # the recipe-explicit API (torch >= 2.10)
broken: dict[str, str] = {}  # kernel -> why it is not used (first error)
_validated: set[tuple[str, int, int]] = set()
# relative error vs x @ Ŵ.T (fp32) above which a kernel's first result is refused: FP8 activations
# cost ~4% (uniform random data, bench/gpu/fp8_gemm.py), bf16 output rounding ~0.3%
_TOLERANCE = {"triton_a8": 0.1, "cublas_a8": 0.1, "triton_a16": 0.02}
_has_triton: list[bool] = []
# cuBLAS has no blockwise-scaled algorithm for some small M (CUBLAS_STATUS_NOT_SUPPORTED at M = 1 on
# the H200, torch 2.11 / CUDA 13); M = 16 and 256 run: activations are padded with zero rows to a multiple
_CUBLAS_ROWS = 16
_pick: dict[tuple[bool, int, int, int], str] = {}  # (act_fp8, M bucket, N, K) -> the fastest kernel
timings: dict[tuple[bool, int, int, int], dict[str, float]] = {}  # the same key -> us per kernel


def has_triton() -> bool:
    if not _has_triton:
        _has_triton.append(importlib.util.find_spec("triton") is not None)
    return _has_triton[0]


def quantize_activations(x2: torch.Tensor, block: int = GEMM_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 codes [M, K], fp32 scales [M, K/block]): one scale per token and block."""
    m, k = x2.shape
    xb = x2.float().view(m, k // block, block)
    amax = xb.abs().amax(dim=-1)
    s = amax / torch.full_like(amax, E4M3_MAX)
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (xb / s.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.view(m, k), s


def outer_major(xs: torch.Tensor) -> torch.Tensor:
    """Activation scales [M, K/128] with strides (1, M), the layout cuBLAS's 1x128 scaling
    takes. Built explicitly: `xs.t().contiguous().t()` is a no-op at M = 1 (size-1 dims count
    as contiguous whatever their stride) and leaves strides (K/128, 1), which `scaled_mm` refuses."""
    m, kb = xs.shape
    out = torch.empty_strided((m, kb), (1, m), dtype=torch.float32, device=xs.device)
    out.copy_(xs)
    return out


def cublas_weight_scales(scale: torch.Tensor) -> torch.Tensor:
    """Weight scales [N/128, K/128] -> [round_up(K/128, 4), N/128] with strides (1, round_up(K/128, 4)):
    cuBLAS's 128x128 layout. A free view when K/128 is a multiple of 4 (K % 512 == 0)."""
    ws = scale.float()
    pad = (-ws.shape[1]) % 4
    if pad:
        ws = F.pad(ws, (0, pad))
    return ws.t()


_compiled: list[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = []


def _act_quant(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activations` fused by torch.compile (eagerly it is ~8 small kernels); eager if
    compiling fails."""
    if not _compiled:
        try:
            fn = torch.compile(quantize_activations, dynamic=True)
            fn(x2)
            _compiled.append(fn)
        except Exception as exc:  # noqa: BLE001 - e.g. no triton: the eager ops give the same values
            log.warning("fp8_activation_quant_not_compiled", error=f"{type(exc).__name__}: {exc}")
            _compiled.append(quantize_activations)
    return _compiled[0](x2)


def cublas_act_quant(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation codes and `outer_major` scales for `blockwise_mm`: one Triton kernel where
    triton exists (scales written in that layout), else compiled torch ops and a re-layout."""
    if x2.is_cuda and has_triton():
        from miles.models.fp8_triton import quantize_activations as triton_quant

        return triton_quant(x2)
    xq, xs = _act_quant(x2)
    return xq, outer_major(xs)


def blockwise_mm(xq: torch.Tensor, xs: torch.Tensor, codes: torch.Tensor, ws: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] fp8 (scales xs `outer_major`) @ codes [N, K].T (scales ws `cublas_weight_scales`)."""
    return F.scaled_mm(xq, codes.t(), xs, F.ScalingType.BlockWise1x128, ws, F.ScalingType.BlockWise128x128,
                       output_dtype=dtype)


def run(kind: str, x2: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
        bias: torch.Tensor | None) -> torch.Tensor:
    """One kernel, no fallback: x2 [M, K] (bf16/fp16) -> [M, N]."""
    if kind == "cublas_a8":
        m = x2.shape[0]
        pad = (-m) % _CUBLAS_ROWS
        xq, xs = cublas_act_quant(F.pad(x2, (0, 0, 0, pad)) if pad else x2)
        out = blockwise_mm(xq, xs, codes, cublas_weight_scales(scale), x2.dtype)
        if pad:
            out = out[:m]
        return out + bias if bias is not None else out
    if kind in ("triton_a8", "triton_a16"):
        from miles.models.fp8_triton import fp8_linear

        return fp8_linear(x2, codes, scale, bias, quant_x=kind == "triton_a8")
    raise ValueError(f"unknown FP8 GEMM kind {kind!r}; one of {KINDS}")


def usable(kind: str) -> bool:
    if kind in broken:
        return False
    return has_triton() if kind.startswith("triton") else HAS_SCALED_MM


def _m_bucket(m: int) -> int:
    return max(16, 1 << (m - 1).bit_length())


def cuda_linear(x2: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                act_fp8: bool) -> torch.Tensor | None:
    """The fastest usable kernel's result for this shape, or None (the caller computes with the
    dequantized weights). The first call per (M bucket, N, K) outside a CUDA-graph capture runs
    every usable kernel, checks it, times it (graph replays) and keeps the fastest."""
    kinds = [k for k in (("cublas_a8", "triton_a8") if act_fp8 else ("triton_a16",)) if usable(k)]
    key = (act_fp8, _m_bucket(x2.shape[0]), codes.shape[0], codes.shape[1])
    capturing = x2.is_cuda and torch.cuda.is_current_stream_capturing()
    if key not in _pick and not capturing and len(kinds) > 1:
        timed = {}
        for kind in kinds:
            if _checked(kind, x2, codes, scale, bias) is not None:
                timed[kind] = graph_time(functools.partial(run, kind, x2, codes, scale, bias)) * 1e3
        if timed:
            _pick[key] = min(timed, key=timed.__getitem__)
            timings[key] = {k: round(t, 2) for k, t in timed.items()}
    if key in _pick and _pick[key] in kinds:
        kinds.remove(_pick[key])
        kinds.insert(0, _pick[key])
    for kind in kinds:
        y = _checked(kind, x2, codes, scale, bias, capturing)
        if y is not None:
            return y
    return None


def _checked(kind: str, x2: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
             capturing: bool = False) -> torch.Tensor | None:
    """`run(kind)`, or None with the kernel refused for good if it raises or (first result per
    (N, K), outside a capture) disagrees with the dequantized weights."""
    if not usable(kind):
        return None
    try:
        y = run(kind, x2, codes, scale, bias)
    except Exception as exc:  # noqa: BLE001 - e.g. no sm90 kernels in this torch/GPU: try the next
        _refuse(kind, f"{type(exc).__name__}: {exc}")
        return None
    key = (kind, codes.shape[0], codes.shape[1])
    if key not in _validated and not capturing:
        err = rel_error(y, x2, codes, scale, bias)
        if err is not None:
            if not err <= _TOLERANCE[kind]:  # NaN refused too
                _refuse(kind, f"result differs from the dequantized weights' by {err:.3g} (relative)")
                return None
            _validated.add(key)
    return y


def rel_error(y: torch.Tensor, x2: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None) -> float | None:
    """|y - x @ Ŵ.T| / |x @ Ŵ.T| (Frobenius, fp32 reference) over the rows whose reference is
    finite and not all zero (a warm-up's padding rows may be anything); None without such rows."""
    ref = F.linear(x2.float(), dequantize_blockwise(codes, scale, (GEMM_BLOCK, GEMM_BLOCK), torch.float32),
                   None if bias is None else bias.float())
    rows = torch.isfinite(ref).all(-1) & (ref != 0).any(-1)
    if not bool(rows.any()):
        return None
    ref = ref[rows]
    return float((y.float()[rows] - ref).norm() / ref.norm())


def _refuse(kind: str, why: str) -> None:
    broken[kind] = why
    log.warning("fp8_gemm_unavailable", kernel=kind, error=why, fallback="next kernel or dequantized weights")
