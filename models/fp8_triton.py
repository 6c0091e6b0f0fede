"""Triton kernels for the FP8 contract's linear layers on CUDA: one kernel per projection.

Imported only on CUDA, by `models/fp8_linear.py` (the CPU path never needs triton).

`y = x @ Ŵ.T` with `Ŵ = s · code` (fp32 scale per 128x128 weight block), two variants:

- `quant_x=True` (W8A8): activations quantized per token and 128 columns (`amax / 448`,
  round to E4M3: the codes of `fp8_gemm.quantize_activations`) and multiplied on the FP8
  tensor cores; each K-block's partial product is scaled by `x_scale[token] · w_scale[block]`.
  The quantization runs either inside the GEMM (no extra launch; each CTA column re-quantizes
  its activation tile) or as one small kernel before it (`quantize_activations` here, which
  replaces the ~8 eager kernels, or one compiled one, plus a scale re-layout of the cuBLAS
  path); the faster is kept per shape.
- `quant_x=False` (W8A16): the weight tile is dequantized in registers to `Ŵ` in the
  activation dtype (the same fp32 product and cast as `fp8.dequantize_blockwise`, so the same
  values the trainer computes with) and multiplied on the bf16 tensor cores: the contract's
  weights exactly, at half the weight bytes of bf16.

Tile shapes (and the W8A8 strategy) are chosen per (variant, M bucket, N, K) by timing a few
candidates once, outside CUDA graph capture (the engine warms every decode bucket up before
capturing it); while capturing an untimed shape gets a default.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from miles.models.graph_timing import graph_time

BLOCK_K = 128  # = the weight block: one scale per K-step


A16, A8_FUSED, A8_PREQUANT = 0, 1, 2  # the kernel's X_MODE


@triton.jit(do_not_specialize=["M"])
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [M, K] -> codes [M, K] e4m3 and scales stored [K/128, M] (read as [M, K/128] with
    strides (1, M): the layout cuBLAS's 1x128 scaling takes too)."""
    pid_m = tl.program_id(0)
    kb = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    m_ok = rm < M
    x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=m_ok[:, None], other=0.0)
    xf = x.to(tl.float32)
    xs = tl.math.div_rn(tl.max(tl.abs(xf), axis=1), 448.0)
    xs = tl.where(xs > 0, xs, 1.0)
    xq = tl.minimum(tl.maximum(tl.math.div_rn(xf, xs[:, None]), -448.0), 448.0).to(tl.float8e4nv)
    tl.store(q_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], xq, mask=m_ok[:, None])
    tl.store(s_ptr + kb * M + rm, xs, mask=m_ok)


@triton.jit(do_not_specialize=["M"])
def _fp8_linear_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                       stride_ym, X_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)  # fastest: the CTAs sharing one weight tile run together (L2 reuse)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]  # [BLOCK_K, BLOCK_N], K-major
    s_ptrs = s_ptr + (rn // BLOCK_K) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // BLOCK_K):
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        ws = tl.load(s_ptrs + kb, mask=n_ok, other=1.0)
        if X_MODE == 1:  # A8_FUSED: quantize this activation tile here
            xf = x.to(tl.float32)
            xs = tl.math.div_rn(tl.max(tl.abs(xf), axis=1), 448.0)
            xs = tl.where(xs > 0, xs, 1.0)
            xq = tl.minimum(tl.maximum(tl.math.div_rn(xf, xs[:, None]), -448.0), 448.0).to(tl.float8e4nv)
            acc += tl.dot(xq, w) * (xs[:, None] * ws[None, :])
        elif X_MODE == 2:  # A8_PREQUANT: x holds codes, its scales stored [K/128, M]
            xs = tl.load(xs_ptr + kb * M + rm, mask=m_ok, other=1.0)
            acc += tl.dot(x, w) * (xs[:, None] * ws[None, :])
        else:  # A16: Ŵ in the activation dtype, as fp8.dequantize_blockwise computes it
            wd = (w.to(tl.float32) * ws[None, :]).to(x.dtype)
            acc = tl.dot(x, wd, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 128 == 0) -> (codes [M, K] e4m3, scales [M, K/128] fp32 with strides (1, M)):
    `fp8_gemm.quantize_activations` in one kernel."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((k // BLOCK_K, m), device=x.device, dtype=torch.float32)
    bm = 16 if m <= 16 else 32
    _act_quant_kernel[(triton.cdiv(m, bm), k // BLOCK_K)](x, q, s, m, k, x.stride(0), BLOCK_M=bm, BLOCK_K=BLOCK_K,
                                                         num_warps=4)
    return q, s.t()


Config = tuple[int, int, int, int, bool]  # BLOCK_M, BLOCK_N, num_warps, num_stages, activations pre-quantized
_chosen: dict[tuple[bool, int, int, int], Config] = {}
timings: dict[tuple[bool, int, int, int], dict[str, float]] = {}


def _m_bucket(m: int) -> int:
    return max(16, 1 << (m - 1).bit_length())


def _candidates(m: int, quant_x: bool) -> list[Config]:
    """Tiles to time; for W8A8 each with the activation quantization fused into the GEMM (no
    extra launch; the tile is re-quantized by every CTA column) or in its own kernel first."""
    bm = min(_m_bucket(m), 64)
    tiles = [(bm, 32, 4, 4), (bm, 64, 4, 4), (bm, 128, 4, 3)]
    if m >= 128:
        tiles.append((128, 128, 8, 3))
    elif bm < 64:  # in case the small-M tiles (no wgmma at M < 64) do not build on this GPU
        tiles.append((64, 64, 4, 4))
    return [(*t, pre) for pre in ((False, True) if quant_x else (False,)) for t in tiles]


def _default(m: int, n: int, quant_x: bool) -> Config:
    """Untimed choice (while a CUDA graph is being captured): enough CTAs to fill the GPU."""
    tiles = _candidates(m, quant_x)[:3]
    for c in reversed(tiles):
        if triton.cdiv(m, c[0]) * triton.cdiv(n, c[1]) >= 96:
            return c
    return tiles[0]


def _launch(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
            y: torch.Tensor, quant_x: bool, cfg: Config) -> None:
    m, k = x.shape
    n = codes.shape[0]
    bm, bn, warps, stages, pre = cfg
    xs = y  # unused unless pre-quantized (any pointer will do)
    if quant_x and pre:
        x, xs = quantize_activations(x)
    mode = (A8_PREQUANT if pre else A8_FUSED) if quant_x else A16
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _fp8_linear_kernel[grid](x, xs, codes, scale, bias if bias is not None else y, y, m, n, k,
                             x.stride(0), codes.stride(0), scale.stride(0), y.stride(0),
                             X_MODE=mode, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
                             BLOCK_K=BLOCK_K, num_warps=warps, num_stages=stages)


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               quant_x: bool) -> torch.Tensor:
    """x [M, K] (bf16/fp16) @ Ŵ.T -> [M, N] in x's dtype. codes [N, K] float8_e4m3fn, scale
    [ceil(N/128), K/128] fp32 (K % 128 == 0)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = codes.shape[0]
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    key = (quant_x, _m_bucket(m), n, k)
    cfg = _chosen.get(key)
    if cfg is None:
        if torch.cuda.is_current_stream_capturing():
            cfg = _default(m, n, quant_x)
        else:
            timed: dict[Config, float] = {}
            errors: list[str] = []
            for c in _candidates(m, quant_x):
                try:
                    timed[c] = graph_time(functools.partial(_launch, x, codes, scale, bias, y, quant_x, c))
                except Exception as exc:  # noqa: BLE001 - e.g. a tile too large for shared memory: skip it
                    errors.append(f"{c}: {type(exc).__name__}: {exc}")
            if not timed:
                raise RuntimeError("no tile configuration of the FP8 Triton kernel ran: " + "; ".join(errors))
            cfg = _chosen[key] = min(timed, key=timed.__getitem__)
            timings[key] = {str(c): round(t * 1e3, 2) for c, t in timed.items()}  # us, for the bench
    _launch(x, codes, scale, bias, y, quant_x, cfg)
    return y
