"""AdamW and the learning-rate schedule (linear warm-up, then constant / linear / cosine decay).

The schedule is a pure function of the optimizer step, so a checkpoint only needs the step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from miles.core.errors import ConfigError
from miles.core.schema.trainer import OptimConfig, OptimImpl


def lr_at(cfg: OptimConfig, step: int) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant" or cfg.decay_steps <= 0:
        return cfg.lr
    frac = min(max(step - cfg.warmup_steps, 0) / cfg.decay_steps, 1.0)
    if cfg.schedule == "linear":
        shape = 1.0 - frac
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * frac))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * shape


def adamw_kernel(impl: OptimImpl, device: torch.device | None) -> dict[str, bool]:
    """torch.optim.AdamW's kernel flags for `trainer.optim.impl` (resolved for the trainer's
    device: core/schema/runtime.py) on `device`."""
    if impl not in ("single", "foreach", "fused"):
        raise ConfigError(f"trainer.optim.impl={impl!r} is not resolved: build the trainer through "
                          "core/schema/runtime.py resolve_trainer")
    if impl == "fused" and (device is None or device.type not in ("cuda", "cpu")):
        raise ConfigError(f"trainer.optim.impl=fused needs a CUDA or CPU device, got {device}")
    return {"foreach": impl == "foreach", "fused": impl == "fused"}


def build_adamw(
    params: Iterable[torch.nn.Parameter], cfg: OptimConfig, device: torch.device | None = None
) -> torch.optim.AdamW:
    ps = [p for p in params if p.requires_grad]
    return torch.optim.AdamW(
        ps,
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        # one parameter at a time is about ten kernel launches per tensor per step; on CUDA the
        # fused kernel does the whole group in a few (not yet timed on the H200: issue 27)
        **adamw_kernel(cfg.impl, device),
    )


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
