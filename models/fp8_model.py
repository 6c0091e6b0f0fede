"""The FP8 contract over a whole model: which projections it quantizes (attention and dense MLP
ones, with their HF row split), putting a model under it (trainer: `attach_fp8`; engine:
`to_fp8_weights`), the HF names it quantizes and the weight-sync hook `fp8_export`.

The per-layer compute (`project`) is models/fp8_linear.py, which the layers import; this module
knows the model graph and sits above it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.models.fp8 import FP8, SCALE_SUFFIX
from miles.models.fp8_layout import Fp8Plan, fp8_block, quantize_hf_state, quantize_rows
from miles.models.fp8_linear import GEMM_ATTR, PLAN_ATTR
from miles.models.hf_names import hf_param_slices
from miles.models.layers import MLP, Attention


def _linear_plans(model: nn.Module, block: tuple[int, int]) -> list[tuple[nn.Linear, Fp8Plan]]:
    """The quantized projections of attention and dense MLP modules, with their HF row split.
    Exact classes only: a subclass with its own forward may not route through `project`."""
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
        setattr(lin, PLAN_ATTR, plan)
    return len(plans)


@torch.no_grad()
def to_fp8_weights(model: nn.Module, block: tuple[int, int], gemm: bool = True) -> int:
    """Engine side: replace each quantized projection's float weight by its FP8 codes and add
    its `weight_scale_inv` parameter (computed from the weights as they are now, in their
    dtype). Returns the number of projections converted; already converted ones are skipped.
    `gemm` False: on CUDA too, compute with the dequantized weights (activations not rounded)."""
    n = 0
    for lin, plan in _linear_plans(model, block):
        setattr(lin, PLAN_ATTR, plan)
        setattr(lin, GEMM_ATTR, gemm)
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
    them back (weightsync/stager.py), and a checksum of either is the same xxh64 of the bytes.
    The codes are those of the bf16-rounded weights (`fp8.contract_input`), so an fp32 or bf16
    export gives the codes the trainer's forward uses; cast the unquantized tensors to the
    engine's dtype as usual (before or after this hook)."""
    block = fp8_block(spec)
    if block is None:
        yield from named
        return
    for name, t in quantize_hf_state(named, block, fp8_hf_names(spec)):
        yield name, (t.view(torch.uint8) if t.dtype == FP8 else t)
