"""Which weights the FP8 contract quantizes, and how their codes and scales are laid out.

The quantization unit is one Hugging Face tensor, as in DeepSeek-V3-style checkpoints:
`X.weight` (float8_e4m3fn codes) plus `X.weight_scale_inv` (fp32, one per block). The
linear layers of attention and of dense MLPs (shared experts included) are quantized:
`q/k/v/o_proj` and `gate/up/down_proj`; embeddings, the LM head, norms, routers and routed
experts stay in the compute dtype. miles fuses q|k|v and gate|up into one parameter; its
codes are the HF codes stacked by rows, and its scale grid the HF scale grids stacked by
rows, so each HF tensor keeps its own blocks (an `Fp8Plan` lists the row segments).

A model runs under the contract when its config carries
`quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [br, bc],
"activation_scheme": "dynamic"}` (`fp8_block`, `with_fp8`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from miles.core.errors import ConfigError
from miles.models.config import ModelSpec
from miles.models.errors import CheckpointError
from miles.models.fp8 import FP8, SCALE_SUFFIX, dequantize_blockwise, quantize_blockwise

# HF names of the quantized tensors (routed experts `mlp.experts.N.*` are not matched).
QUANTIZED_HF = re.compile(
    r"^(.*\.)?layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(shared_experts?\.)?(gate|up|down)_proj)\.weight$"
)


def fp8_block(spec: ModelSpec) -> tuple[int, int] | None:
    """The weight block of the model's blockwise FP8 quantization_config, or None (no FP8)."""
    qc = spec.hf_config.get("quantization_config")
    if qc is None:
        return None
    return parse_quantization_config(qc)


def parse_quantization_config(qc: Any) -> tuple[int, int]:
    """Validate an HF `quantization_config`; only blockwise FP8 E4M3 is supported."""
    where = "model config quantization_config"
    if not isinstance(qc, dict):
        raise ConfigError(f"{where} must be a dict, got {type(qc).__name__}")
    if qc.get("quant_method") != "fp8":
        raise ConfigError(f"{where}: quant_method={qc.get('quant_method')!r} is not supported (only 'fp8')")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"{where}: fmt={qc.get('fmt')!r} is not supported (only 'e4m3')")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(f"{where}: activation_scheme={qc.get('activation_scheme')!r}: only 'dynamic' "
                          "(activations are quantized per token at run time; no static activation scales)")
    block = qc.get("weight_block_size")
    if (not isinstance(block, list | tuple) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"{where}: weight_block_size={block!r} must be two positive ints (blockwise FP8; "
                          "per-tensor FP8 checkpoints are not supported)")
    return int(block[0]), int(block[1])


def quantization_config(block: tuple[int, int]) -> dict[str, Any]:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [int(block[0]), int(block[1])]}


def with_fp8(spec: ModelSpec, block: tuple[int, int]) -> ModelSpec:
    """The same architecture under the FP8 contract with this weight block."""
    cfg = dict(spec.hf_config)
    cfg["quantization_config"] = quantization_config(block)
    return dataclasses.replace(spec, hf_config=cfg)


@dataclass(frozen=True)
class Fp8Plan:
    """How one (possibly fused) linear weight is quantized: its HF row segments, the block."""

    block: tuple[int, int]
    rows: tuple[int, ...]

    def scale_rows(self) -> tuple[int, ...]:
        return tuple(-(-r // self.block[0]) for r in self.rows)

    @property
    def block_aligned(self) -> bool:
        """Every segment a whole number of row blocks: the stacked grid is the fused one's."""
        return all(r % self.block[0] == 0 for r in self.rows)


def quantize_rows(w: torch.Tensor, plan: Fp8Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [N, K] fp8, scale_inv [sum Rb_i, Kb] fp32): each row segment quantized alone."""
    if sum(plan.rows) != w.shape[0]:
        raise ValueError(f"FP8 plan rows {plan.rows} do not cover a weight of shape {tuple(w.shape)}")
    codes, scales, pos = [], [], 0
    for r in plan.rows:
        c, s = quantize_blockwise(w[pos:pos + r], plan.block)
        codes.append(c)
        scales.append(s)
        pos += r
    if len(codes) == 1:
        return codes[0], scales[0]
    return torch.cat(codes), torch.cat(scales)


def dequantize_rows(codes: torch.Tensor, scale_inv: torch.Tensor, plan: Fp8Plan, dtype: torch.dtype) -> torch.Tensor:
    """Ŵ [N, K] in `dtype` from stacked codes and scale grids (the inverse layout of `quantize_rows`)."""
    out, pos, spos = [], 0, 0
    for r, sr in zip(plan.rows, plan.scale_rows(), strict=True):
        out.append(dequantize_blockwise(codes[pos:pos + r], scale_inv[spos:spos + sr], plan.block, dtype))
        pos, spos = pos + r, spos + sr
    return out[0] if len(out) == 1 else torch.cat(out)


def scale_row_slices(name: str, scale_rows: int, spec: ModelSpec) -> list[tuple[str, slice]]:
    """HF names of the scale grids stacked in the model parameter `name` (`...X.weight_scale_inv`)
    with `scale_rows` rows: (HF name, row slice), mirroring the weight's own split."""
    block = fp8_block(spec)
    if block is None:
        raise CheckpointError(f"parameter {name!r} is an FP8 scale, but the model config has no FP8 quantization_config")
    if ".self_attn.qkv_proj." in name:
        pre = name.split(".qkv_proj.")[0]
        nq, nk = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        plan = Fp8Plan(block, (nq, nk, nk))
        parts = [f"{pre}.{p}_proj.weight{SCALE_SUFFIX}" for p in "qkv"]
    elif ".gate_up_proj." in name:
        pre = name.split(".gate_up_proj.")[0]
        half = scale_rows // 2
        return [(f"{pre}.gate_proj.weight{SCALE_SUFFIX}", slice(0, half)),
                (f"{pre}.up_proj.weight{SCALE_SUFFIX}", slice(half, scale_rows))]
    else:
        return [(name, slice(None))]
    out, pos = [], 0
    for part, sr in zip(parts, plan.scale_rows(), strict=True):
        out.append((part, slice(pos, pos + sr)))
        pos += sr
    return out


def quantize_hf_state(
    named: Iterable[tuple[str, torch.Tensor]],
    block: tuple[int, int],
    names: Collection[str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named weights -> the FP8 checkpoint / sync form: every quantized `X.weight` becomes
    `X.weight` (float8_e4m3fn codes, same shape) followed by `X.weight_scale_inv` (fp32);
    the others pass unchanged. Streams one tensor at a time. Codes are those of the tensor
    rounded to bf16 (`fp8.contract_input`), whatever its dtype.

    `names`: the HF names the model quantizes (`fp8_linear.fp8_hf_names(spec)`); None = every
    name of the standard attention/MLP layout (`QUANTIZED_HF`)."""
    for name, t in named:
        hit = QUANTIZED_HF.match(name) is not None if names is None else name in names
        if hit and t.dtype != FP8:
            codes, scale = quantize_blockwise(t, block)
            yield name, codes
            yield name + SCALE_SUFFIX, scale
        else:
            yield name, t


def dequantize_hf_state(
    named: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse for loading: `X.weight` (fp8) + `X.weight_scale_inv` -> `X.weight` in fp32
    (the order of the two within the stream does not matter); other tensors pass unchanged."""
    codes: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, t in named:
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base in codes:
                yield base, _dequant(base, codes.pop(base), t, block)
            else:
                scales[base] = t
        elif t.dtype == FP8:
            if name in scales:
                yield name, _dequant(name, t, scales.pop(name), block)
            else:
                codes[name] = t
        else:
            yield name, t
    if codes or scales:
        lone = sorted(codes)[:3] + [n + SCALE_SUFFIX for n in sorted(scales)[:3]]
        raise CheckpointError(f"FP8 checkpoint: tensors without their codes/scale partner: {', '.join(lone)}")


def _dequant(name: str, codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    if block is None:
        raise CheckpointError(f"tensor {name!r} is FP8, but config.json has no quantization_config")
    want = (-(-codes.shape[0] // block[0]), -(-codes.shape[1] // block[1])) if codes.dim() == 2 else None
    if want is None or tuple(scale.shape) != want:
        raise CheckpointError(f"FP8 tensor {name!r} of shape {tuple(codes.shape)} has a scale of shape "
                              f"{tuple(scale.shape)}; blocks {block} need {want}")
    return dequantize_blockwise(codes, scale, block, torch.float32)
