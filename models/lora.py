"""The one definition of a LoRA-merged weight, shared by the trainer and the engines."""

from __future__ import annotations

import torch


def merge_weight(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W0 + scale * B @ A, for W0 [out, in], A [r, in], B [out, r]."""
    return w0 + (b @ a) * scale
