"""The one definition of a LoRA-merged weight and of the adapter sync payload, shared by the
trainer and the engines.

The payload of an adapter-only sync is one (name, tensor) pair per adapter matrix,
`<module>.lora_A` [r, in] and `<module>.lora_B` [out, r] (`<module>` the adapted linear
layer's module name, e.g. `model.layers.0.self_attn.qkv_proj`), plus `lora.scale`: a
float64 tensor holding alpha / r, so an engine needs no trainer config to merge.
"""

from __future__ import annotations

import torch

SCALE_NAME = "lora.scale"
_SUFFIXES = (".lora_A", ".lora_B")


def merge_weight(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W0 + scale * B @ A, for W0 [out, in], A [r, in], B [out, r]."""
    # torch.mm, not @: the batch-invariant mode tiles `@`, and the trainer (whose parametrized
    # weight is merged inside the forward) must merge exactly as the engine does outside it
    return w0 + torch.mm(b, a) * scale


def is_adapter_name(name: str) -> bool:
    """True for the names of an adapter sync payload (adapter matrices and the scale)."""
    return name == SCALE_NAME or name.endswith(_SUFFIXES)


def scale_tensor(scale: float) -> torch.Tensor:
    """`lora.scale` as it travels: one float64 element (exact for any Python float)."""
    return torch.tensor([scale], dtype=torch.float64)
