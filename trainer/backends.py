"""Trainer backends by `trainer.backend` tag, and the launch-time check of the chosen backend.

Entries are import paths, so megatron-core is imported only when 'megatron' is chosen.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from miles.core.hooks import Registry
from miles.core.schema.trainer import TrainerConfig

if TYPE_CHECKING:  # models.config imports torch, which the launcher's checks do without
    import torch

    from miles.models.config import ModelSpec
    from miles.trainer.batch import TrainBatch
    from miles.weightsync.flat import FlatWeights
    from miles.weightsync.shard_plan import ShardExport


class TrainerBackend(Protocol):
    """What the trainer actor (actors/trainer.py) and the weight publishers use of a backend:
    FSDPTrainer (trainer/fsdp.py) and MegatronTrainer (trainer/megatron/trainer.py)."""

    step: int  # RL steps taken
    weight_version: int  # the version of the weights it holds (one per step)

    @property
    def cfg(self) -> TrainerConfig: ...  # its section, as this rank resolved it

    @property
    def device(self) -> torch.device: ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL step on this rank's shard of the batch; its metrics."""
        ...

    def nonfinite_weights(self) -> list[str]: ...

    def offload(self) -> float:
        """Move its state to host memory until the next step; seconds spent."""
        ...

    def export_sync_state(self, flat: bool = False, dtype: torch.dtype | None = None
                          ) -> Iterable[tuple[str, torch.Tensor]] | FlatWeights: ...

    def export_sharded_state(self, dtype: torch.dtype | None = None) -> ShardExport: ...

    def export_hf_checkpoint(self, path: str | Path) -> None: ...

    def save_checkpoint(self, path: str | Path) -> None: ...

    def load_checkpoint(self, path: str | Path) -> None: ...


TRAINERS = Registry(
    "trainer.backend",
    {
        "fsdp": "miles.trainer.fsdp:FSDPTrainer",
        "megatron": "miles.trainer.megatron.trainer:MegatronTrainer",
    },
)


def check_backend(cfg: TrainerConfig, spec: ModelSpec | None, world: int) -> None:
    """Launch-time checks of `cfg.backend` beyond the config (which the loader checked):
    megatron-core must run here, and its parallel sizes must fit the model when it is known."""
    if cfg.backend == "megatron":
        from miles.trainer.megatron.available import require_megatron
        from miles.trainer.megatron.build import check_parallel

        require_megatron()
        if spec is not None:
            check_parallel(cfg.megatron, spec, world)


def make_trainer(cfg: TrainerConfig, spec: ModelSpec, rank: int, world: int, **kw: Any) -> TrainerBackend:
    """The backend's trainer class instantiated with FSDPTrainer's constructor arguments."""
    trainer: TrainerBackend = TRAINERS.get(cfg.backend)(cfg, spec, rank, world, **kw)
    return trainer


def data_parallel(trainer: TrainerBackend, rank: int, world: int) -> tuple[int, int]:
    """(dp_size, dp_rank) a trainer takes its batch shard by: a backend with model
    parallelism (megatron TP) reports its own; otherwise every rank is a data-parallel rank."""
    return int(getattr(trainer, "dp_size", world)), int(getattr(trainer, "dp_rank", rank))


if TYPE_CHECKING:  # checked by mypy (scripts/typecheck.py), never run: both backends satisfy the Protocol
    from miles.trainer.fsdp import FSDPTrainer
    from miles.trainer.megatron.trainer import MegatronTrainer

    _BACKENDS: tuple[type[TrainerBackend], ...] = (FSDPTrainer, MegatronTrainer)
