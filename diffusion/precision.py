"""Per-parameter precision: name patterns kept in FP32 while the rest of the model is BF16.

Precision-sensitive parameters (the timestep embedding above all: it turns t into features
whose small differences matter at every denoising step) stay FP32 while the bulk runs in
BF16. Patterns are `fnmatch` globs over parameter names, e.g. ``time_embed.*``. The model's
layers compute in their own weight's dtype (diffusion/model.py), so a mixed model needs no
autocast. The trainer maps the same list onto FSDP2 units (diffusion/trainer.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

import torch
from torch import nn

from miles.core.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def dtype_of(name: str, where: str) -> torch.dtype:
    dt = DTYPES.get(name)
    if dt is None:
        raise ConfigError(f"{where}={name!r}: expected one of {', '.join(DTYPES)}")
    return dt


def keeps_fp32(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatchcase(name, p) for p in patterns)


def param_dtypes(model: nn.Module, dtype: torch.dtype, fp32_patterns: list[str]) -> dict[str, torch.dtype]:
    """Parameter name -> the dtype it is held in: FP32 where a pattern matches, else `dtype`.

    A pattern that matches no parameter is a config error (a typo would silently keep
    everything in BF16 and the measurement would be of the wrong thing).
    """
    names = [n for n, _ in model.named_parameters()]
    for p in fp32_patterns:
        if not any(fnmatchcase(n, p) for n in names):
            raise ConfigError(f"precision.fp32_params: pattern {p!r} matches no parameter; "
                              f"names look like {', '.join(names[:4])}, ...")
    return {n: torch.float32 if keeps_fp32(n, fp32_patterns) else dtype for n in names}


@torch.no_grad()
def apply_precision(model: nn.Module, dtype: torch.dtype, fp32_patterns: list[str]) -> nn.Module:
    """Cast `model`'s parameters in place to their per-parameter dtypes; returns the model."""
    want = param_dtypes(model, dtype, fp32_patterns)
    for name, p in model.named_parameters():
        if p.dtype != want[name]:
            p.data = p.data.to(want[name])
    return model


def fp32_fraction(model: nn.Module) -> float:
    """Share of parameter elements held in FP32 (what per-parameter FP32 costs in memory)."""
    tot = sum(p.numel() for p in model.parameters())
    f32 = sum(p.numel() for p in model.parameters() if p.dtype == torch.float32)
    return f32 / max(tot, 1)
