"""HF tensor names of model parameters: which HF tensors one `CausalLM` parameter holds (fused
q/k/v and gate/up projections split into row slices, stacked experts into per-expert tensors).

Names only: it builds no model and reads no checkpoint (models/hf_io.py does), so the FP8
contract's name list (models/fp8_model.py) and the flat export can use it without the IO.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miles.models.config import ModelSpec
from miles.models.errors import CheckpointError
from miles.models.fp8 import SCALE_SUFFIX
from miles.models.fp8_layout import scale_row_slices

_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class HFSlice:
    """Where one HF tensor sits inside a model parameter: `param[expert][rows]`
    (expert None: no expert axis; rows: a slice of the remaining first axis)."""

    hf_name: str
    expert: int | None
    rows: slice

    def view(self, param: torch.Tensor) -> torch.Tensor:
        t = param if self.expert is None else param[self.expert]
        return t[self.rows]


_ALL = slice(None)


def hf_param_slices(spec: ModelSpec, name: str, shape: Sequence[int]) -> list[HFSlice]:
    """The HF tensors held by the model parameter `name` of shape `shape` (its full,
    unsharded shape): fused q/k/v and gate/up projections are split into row slices,
    stacked experts into per-expert tensors; any other parameter maps to itself."""
    if name.endswith(SCALE_SUFFIX):  # an FP8 engine's block scales, stacked like its codes
        return [HFSlice(n, None, rows) for n, rows in scale_row_slices(name, shape[0], spec)]
    m = _EXPERTS.match(name)
    if m and spec.model_type != "gpt_oss":  # gpt-oss checkpoints keep experts stacked, as we do
        if len(shape) != 3:
            raise CheckpointError(f"expert parameter {name!r} should be 3-D [E, rows, cols], got shape {tuple(shape)}")
        out = []
        for e in range(shape[0]):
            pre = f"{m.group(1)}.{e}"
            if m.group(2) == "gate_up_proj":
                half = shape[1] // 2
                out += [HFSlice(f"{pre}.gate_proj.weight", e, slice(0, half)),
                        HFSlice(f"{pre}.up_proj.weight", e, slice(half, shape[1]))]
            else:
                out.append(HFSlice(f"{pre}.down_proj.weight", e, _ALL))
        return out
    if ".self_attn.qkv_proj." in name:
        nq, nk = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        pre, kind = name.split(".qkv_proj.")
        return [
            HFSlice(f"{pre}.q_proj.{kind}", None, slice(0, nq)),
            HFSlice(f"{pre}.k_proj.{kind}", None, slice(nq, nq + nk)),
            HFSlice(f"{pre}.v_proj.{kind}", None, slice(nq + nk, nq + 2 * nk)),
        ]
    if ".gate_up_proj." in name:  # a dense MLP or a MoE layer's shared experts
        pre, kind = name.split(".gate_up_proj.")
        half = shape[0] // 2
        return [
            HFSlice(f"{pre}.gate_proj.{kind}", None, slice(0, half)),
            HFSlice(f"{pre}.up_proj.{kind}", None, slice(half, shape[0])),
        ]
    return [HFSlice(name, None, _ALL)]
