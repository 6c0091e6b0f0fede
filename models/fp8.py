"""The shared low-precision quantizer: FP8 E4M3 codes with one fp32 scale per weight block.

The contract (seed paper, "Trainer Design and Precision"): the trainer and the engine
run their forward passes on the same `Ŵ = s · code`, with `code = round(W / s)` clamped
to the code range. One function computes it for both, and it gives the same bits on
every device and in every process:

- `W` is first rounded to bf16, so fp32 masters, their bf16 forward cast and an fp32 or bf16
  sync copy of them all give the same codes (`contract_input`).
- `s` is the dequantization scale of a block (`weight_scale_inv` in DeepSeek-V3-style
  checkpoints): `amax(|W_block|) / 448` in fp32 (1 for an all-zero block).
- Only ops IEEE 754 rounds one way are used: max, tensor/tensor division, multiplication,
  round-half-even on exact operands, integer bit operations. A scalar divisor is avoided
  (CUDA's division kernel turns `t / 448.0` into `t * (1/448)`, which differs in the last
  bit); the rounding onto the E4M3 grid is done here with exact power-of-two rescaling, so
  the final cast to `float8_e4m3fn` has nothing left to round (the device casts then cannot
  disagree on ties, subnormals or overflow).
- Codes saturate at ±448 (E4M3FN has no infinity; torch's plain cast would give NaN above
  480 and is never asked to).

Blocks tile a 2-D weight [rows, cols] in `block = (block_rows, block_cols)` tiles (the last
ones partial); the scale grid is [ceil(rows / br), ceil(cols / bc)].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
_MANTISSA_BITS = 3
_MIN_NORMAL_EXP = -6  # below 2^-6 E4M3 is subnormal: the grid step stays 2^-9
SCALE_SUFFIX = "_scale_inv"  # `X.weight` -> `X.weight_scale_inv`, the DeepSeek-V3 convention
DEFAULT_BLOCK = (128, 128)
CONTRACT_DTYPE = torch.bfloat16  # weights are rounded to it before quantizing (`contract_input`)


@dataclass(frozen=True)
class IntGrid:
    """Integer codes in [lo, hi]: the worked example of the paper (codes clamped to [-4, 3])."""

    lo: int
    hi: int

    def round(self, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x).clamp(self.lo, self.hi)


@dataclass(frozen=True)
class E4M3Grid:
    """The FP8 E4M3FN value grid: 3 mantissa bits, saturating at ±448."""

    lo: float = -E4M3_MAX
    hi: float = E4M3_MAX

    def round(self, x: torch.Tensor) -> torch.Tensor:
        return round_e4m3(x)


CodeGrid = IntGrid | E4M3Grid
E4M3 = E4M3Grid()


def _pow2(exp: torch.Tensor) -> torch.Tensor:
    """2**exp (int32 tensor, normal range) built from its bits: exact on every device."""
    return ((exp + 127) << 23).view(torch.float32)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 x -> the nearest E4M3 value (ties to even, saturating at ±448), still fp32.

    The grid step around |x| is 2^(e-3) for |x| in [2^e, 2^(e+1)) (2^-9 below 2^-6): scale
    by the inverse power of two (exact), round half to even, scale back (exact).
    """
    x = x.float()
    a = x.abs().clamp(max=E4M3_MAX)  # NaN stays NaN
    exp = ((a.view(torch.int32) >> 23) & 0xFF) - 127
    exp = exp.clamp(min=_MIN_NORMAL_EXP)
    q = torch.round(a * _pow2(_MANTISSA_BITS - exp)) * _pow2(exp - _MANTISSA_BITS)
    return torch.where((x < 0) & (q > 0), -q, q)  # zero codes are +0: re-quantizing Ŵ gives them back


def _blocked(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    """w [R, C] zero-padded to whole blocks, viewed [Rb, br, Cb, bc]; returns (view, R, C)."""
    if w.dim() != 2:
        raise ValueError(f"blockwise quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    br, bc = block
    if br < 1 or bc < 1:
        raise ValueError(f"block {block} must be positive")
    r, c = w.shape
    pr, pc = (-r) % br, (-c) % bc
    if pr or pc:
        w = F.pad(w, (0, pc, 0, pr))
    return w.view(w.shape[0] // br, br, w.shape[1] // bc, bc), r, c


def contract_input(w: torch.Tensor) -> torch.Tensor:
    """The values the quantizer sees: `w` rounded to bf16 (exact for bf16 weights), in fp32.

    So the codes do not depend on the dtype the weights travel or live in: an fp32 master,
    its bf16 cast in a mixed-precision forward and a bf16 or fp32 weight-sync copy all give the
    same codes and scales (bf16 keeps 8 bits of mantissa, E4M3 keeps 4)."""
    return w.detach().to(CONTRACT_DTYPE).float()


def block_scales(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK, code_max: float = E4M3_MAX) -> torch.Tensor:
    """The fp32 dequantization scale of every block: amax / code_max ([Rb, Cb]; 1 for a zero
    block), of the weight as the contract sees it (`contract_input`)."""
    wb, _, _ = _blocked(contract_input(w), block)
    amax = wb.abs().amax(dim=(1, 3))
    s = amax / torch.full_like(amax, code_max)  # tensor / tensor: IEEE division on every device
    return torch.where(s > 0, s, torch.ones_like(s))


def quantize_blockwise(
    w: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    scale_inv: torch.Tensor | None = None,
    grid: CodeGrid = E4M3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] -> (codes [R, C], scale_inv [Rb, Cb] fp32) with codes = grid.round(w / s).

    Codes are `float8_e4m3fn` for the E4M3 grid, fp32 integers for an `IntGrid`.
    `scale_inv` given: use these scales (e.g. the paper's s = 0.25) instead of amax / max.
    """
    if scale_inv is None:
        scale_inv = block_scales(w, block, float(grid.hi))
    wb, r, c = _blocked(contract_input(w) if isinstance(grid, E4M3Grid) else w.detach().float(), block)
    s = scale_inv.to(device=wb.device, dtype=torch.float32)
    if tuple(s.shape) != (wb.shape[0], wb.shape[2]):
        raise ValueError(f"scale_inv shape {tuple(s.shape)} != block grid {(wb.shape[0], wb.shape[2])}")
    codes = grid.round(wb / s[:, None, :, None]).reshape(wb.shape[0] * wb.shape[1], -1)[:r, :c]
    if isinstance(grid, E4M3Grid):
        codes = codes.to(FP8)  # exact: every value is on the E4M3 grid already
    return codes.contiguous(), s


def dequantize_blockwise(
    codes: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Ŵ = s · code (fp32 product, then cast to `dtype`), [R, C]."""
    cb, r, c = _blocked(codes.float(), block)
    w = cb * scale_inv.float()[:, None, :, None]
    return w.reshape(cb.shape[0] * cb.shape[1], -1)[:r, :c].to(dtype)


def fake_quantize(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """dequantize(quantize(w)) in w's dtype: the weight both sides compute with."""
    codes, s = quantize_blockwise(w, block)
    return dequantize_blockwise(codes, s, block, w.dtype)
