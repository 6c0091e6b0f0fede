"""Linear layers under the FP8 contract: the trainer's fake-quantized forward and the
engine's FP8 weights, both computing with the same `Ŵ` (models/fp8.py).

- Trainer (float master weights, an `Fp8Plan` attached): the forward uses
  `Ŵ = dequant(quant(W))` in the weight's dtype; the backward passes the gradient straight
  through to W (the straight-through estimator: rounding has no useful derivative).
- Engine (`to_fp8_weights`): the weight parameter holds the float8_e4m3fn codes and a
  `weight_scale_inv` parameter the fp32 block scales, both synced and swapped like any
  weight. On the CPU, and in batch-invariant mode, the forward dequantizes them into the
  compute dtype: the trainer's Ŵ bit for bit. On CUDA it runs FP8 GEMMs when the shapes
  allow it (models/fp8_gemm.py): with activations rounded to FP8 per token and 128 columns
  (`engine.fp8_gemm`, fast; logprobs then differ from the trainer's by that rounding), or with
  Ŵ rebuilt inside the kernel in the activation dtype (exact weights, half the bytes).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from miles.core.logging import get_logger
from miles.models.config import ModelSpec
from miles.models.fp8 import FP8, SCALE_SUFFIX
from miles.models.fp8_gemm import GEMM_BLOCK, cuda_linear
from miles.models.fp8_layout import (
    Fp8Plan,
    dequantize_rows,
    fp8_block,
    quantize_hf_state,
    quantize_rows,
)
from miles.models.invariant import invariant_active

log = get_logger("miles.models.fp8")
_PLAN = "fp8_plan"


class _FakeQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, plan: Fp8Plan) -> torch.Tensor:  # type: ignore[override]
        codes, scale = quantize_rows(w, plan)
        return dequantize_rows(codes, scale, plan, w.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def fake_quantized(w: torch.Tensor, plan: Fp8Plan) -> torch.Tensor:
    """Ŵ of a float weight, gradient straight through to `w`."""
    return _FakeQuantSTE.apply(w, plan)  # type: ignore[no-any-return]


def project(x: torch.Tensor, mod: nn.Linear) -> torch.Tensor:
    """`F.linear(x, mod.weight, mod.bias)` under the module's FP8 plan, if it has one."""
    plan: Fp8Plan | None = getattr(mod, _PLAN, None)
    w = mod.weight
    if plan is None:
        return F.linear(x, w, mod.bias)
    if w.dtype == FP8:
        scale = getattr(mod, "weight" + SCALE_SUFFIX)
        if x.is_cuda and not invariant_active() and _gemm_ok(x, w, plan):
            lead, k = x.shape[:-1], x.shape[-1]
            y = cuda_linear(x.reshape(-1, k), w, scale, mod.bias, act_fp8=getattr(mod, "fp8_gemm", True))
            if y is not None:
                return y.view(*lead, w.shape[0])
        w_hat = _cached_dequant(mod, w, scale, plan, x.dtype) if not x.is_cuda else dequantize_rows(
            w, scale, plan, x.dtype)
        return F.linear(x, w_hat, mod.bias)
    return F.linear(x, fake_quantized(w, plan), mod.bias)


_generation = [0]


def weights_changed() -> None:
    """New live weights (an engine commit): drop every cached Ŵ in this process."""
    _generation[0] += 1


def _cached_dequant(mod: nn.Module, codes: torch.Tensor, scale: torch.Tensor, plan: Fp8Plan,
                    dtype: torch.dtype) -> torch.Tensor:
    """CPU engine: Ŵ kept until the codes or scales change, so a decode step does not pay a
    dequantization per layer. Keyed by the weight generation (`weights_changed`, called at every
    engine commit: a receiver may write staged bytes without torch noticing) and by storage
    address and version counter of codes and scales (any in-place torch write)."""
    key = (_generation[0], codes.data_ptr(), codes._version, scale.data_ptr(), scale._version, dtype)
    hit = getattr(mod, "_fp8_cache", None)
    if hit is None or hit[0] != key:
        hit = (key, dequantize_rows(codes, scale, plan, dtype))
        mod._fp8_cache = hit
    return hit[1]  # type: ignore[no-any-return]


def _gemm_ok(x: torch.Tensor, w: torch.Tensor, plan: Fp8Plan) -> bool:
    """Shapes the CUDA FP8 kernels take: 128x128 blocks whose scale grid is one grid over the
    fused rows (every segment whole row blocks), K a multiple of 128, bf16/fp16 activations."""
    return (plan.block == (GEMM_BLOCK, GEMM_BLOCK) and plan.block_aligned and w.shape[1] % GEMM_BLOCK == 0
            and w.shape[0] % 16 == 0 and x.dtype in (torch.bfloat16, torch.float16))


def _linear_plans(model: nn.Module, block: tuple[int, int]) -> list[tuple[nn.Linear, Fp8Plan]]:
    """The quantized projections of attention and dense MLP modules, with their HF row split.
    Exact classes only: a subclass with its own forward may not route through `project`."""
    from miles.models.layers import MLP, Attention

    out: list[tuple[nn.Linear, Fp8Plan]] = []
    for mod in model.modules():
        if type(mod) is Attention:
            nq, nk = mod.nh * mod.hd, mod.nkv * mod.hd
            out += [(mod.qkv_proj, Fp8Plan(block, (nq, nk, nk))),
                    (mod.o_proj, Fp8Plan(block, (mod.o_proj.weight.shape[0],)))]
        elif type(mod) is MLP:
            out += [(mod.gate_up_proj, Fp8Plan(block, (mod.inter, mod.inter))),
                    (mod.down_proj, Fp8Plan(block, (mod.down_proj.weight.shape[0],)))]
    return out


def attach_fp8(model: nn.Module, block: tuple[int, int]) -> int:
    """Put the model's quantized projections under the contract (a trainer-side fake-quantized
    forward while their weights are float); returns how many."""
    plans = _linear_plans(model, block)
    for lin, plan in plans:
        setattr(lin, _PLAN, plan)
    return len(plans)


@torch.no_grad()
def to_fp8_weights(model: nn.Module, block: tuple[int, int], gemm: bool = True) -> int:
    """Engine side: replace each quantized projection's float weight by its FP8 codes and add
    its `weight_scale_inv` parameter (computed from the weights as they are now, in their
    dtype). Returns the number of projections converted; already converted ones are skipped.
    `gemm` False: on CUDA too, compute with the dequantized weights (activations not rounded)."""
    n = 0
    for lin, plan in _linear_plans(model, block):
        setattr(lin, _PLAN, plan)
        lin.fp8_gemm = gemm  # type: ignore[assignment]
        if lin.weight.dtype == FP8:
            continue
        codes, scale = quantize_rows(lin.weight.data, plan)
        lin.weight = nn.Parameter(codes, requires_grad=False)
        lin.register_parameter("weight" + SCALE_SUFFIX, nn.Parameter(scale, requires_grad=False))
        n += 1
    return n


_NAMES: dict[str, frozenset[str]] = {}


def fp8_hf_names(spec: ModelSpec) -> frozenset[str]:
    """HF names of the weights the FP8 contract quantizes in this architecture (empty without
    an FP8 quantization_config). Found on a meta-device build, so it costs no memory."""
    block = fp8_block(spec)
    if block is None:
        return frozenset()
    key = json.dumps(spec.hf_config, sort_keys=True, default=str)
    if key not in _NAMES:
        from miles.models.decoder import CausalLM
        from miles.models.hf_io import hf_param_slices

        with torch.device("meta"):
            model = CausalLM(spec)
        quantized = {id(lin.weight) for lin, _ in _linear_plans(model, block)}
        _NAMES[key] = frozenset(s.hf_name for name, p in model.named_parameters() if id(p) in quantized
                                for s in hf_param_slices(spec, name, p.shape))
    return _NAMES[key]


def fp8_export(named: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """The weight-sync hook: HF-named weights of a model with `spec` -> for every quantized
    weight its codes `X.weight` and fp32 scales `X.weight_scale_inv`; the rest unchanged (all
    unchanged without an FP8 quantization_config). The codes travel as their raw bytes
    (uint8, same shape): the actor wire and gloo have no float8 dtype; an FP8 engine views
    them back (engines/weights.py), and a checksum of either is the same xxh64 of the bytes.
    The codes are those of the bf16-rounded weights (`fp8.contract_input`), so an fp32 or bf16
    export gives the codes the trainer's forward uses; cast the unquantized tensors to the
    engine's dtype as usual (before or after this hook)."""
    block = fp8_block(spec)
    if block is None:
        yield from named
        return
    for name, t in quantize_hf_state(named, block, fp8_hf_names(spec)):
        yield name, (t.view(torch.uint8) if t.dtype == FP8 else t)
