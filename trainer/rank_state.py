"""What every trainer backend keeps beside its models and the RL step, shared by composition:
its checkpoint (trainable modules + optimizer + step counters) and its offload to host memory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from miles.core.errors import TrainerError
from miles.core.logging import get_logger
from miles.trainer import checkpoint
from miles.trainer.offload import FlatOffload, trainer_state_tensors

log = get_logger("trainer.state")


class RankCheckpointed(Protocol):
    """A trainer backend's rank, as its checkpoint sees it."""

    world: int
    opt: torch.optim.Optimizer

    @property
    def trainable(self) -> nn.Module: ...  # read-only: a backend's may be a ModuleDict
    step: int
    opt_steps: int
    weight_version: int

    def ensure_loaded(self) -> None: ...


def save_rank(t: RankCheckpointed, path: str | Path) -> None:
    """Save the trainable modules, the optimizer and the step counters (a collective)."""
    t.ensure_loaded()
    meta = {"step": t.step, "opt_steps": t.opt_steps, "weight_version": t.weight_version, "world": t.world}
    checkpoint.save(path, t.trainable, t.opt, meta)


def load_rank(t: RankCheckpointed, path: str | Path) -> None:
    """Load what `save_rank` saved (a collective)."""
    t.ensure_loaded()
    meta = checkpoint.load(path, t.trainable, t.opt)
    if meta.get("world") != t.world:
        log.warning("checkpoint_world_changed", saved=meta.get("world"), now=t.world)
    t.step = int(meta["step"])
    t.opt_steps = int(meta["opt_steps"])
    t.weight_version = int(meta["weight_version"])


class Offloader:
    """A rank's parameters, optimizer state and frozen models (reference, teacher) moved to host
    memory as one block and back (trainer/offload.py); built at the first offload."""

    def __init__(self, modules: Callable[[], list[nn.Module]], opt: Callable[[], torch.optim.Optimizer],
                 device: torch.device) -> None:
        self._modules, self._opt, self.device = modules, opt, device
        self.block: FlatOffload | None = None  # the one host/device block, once built

    @property
    def offloaded(self) -> bool:
        return self.block is not None and self.block.offloaded

    def offload(self, roots: list[nn.Module]) -> float:
        """Offload (gradients are dropped); returns seconds spent."""
        if self.block is None:
            mods = self._modules()
            self.block = FlatOffload(lambda: trainer_state_tensors(mods, [self._opt()]), self.device)
        return self.block.offload(roots)

    def reload(self) -> float:
        """Bring the offloaded state back to the device; returns seconds spent."""
        if self.block is None:
            raise TrainerError("reload() before any offload()")
        return self.block.reload()

    def ensure_loaded(self) -> None:
        if self.offloaded:
            self.reload()
