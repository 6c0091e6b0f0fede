"""Trainer backends by `trainer.backend` tag, and the launch-time check of the chosen backend.

Entries are import paths, so megatron-core is imported only when 'megatron' is chosen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles.core.hooks import Registry
from miles.core.schema.trainer import TrainerConfig

if TYPE_CHECKING:  # models.config imports torch, which the launcher's checks do without
    from miles.models.config import ModelSpec

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


def make_trainer(cfg: TrainerConfig, spec: ModelSpec, rank: int, world: int, **kw: Any) -> Any:
    """The backend's trainer class instantiated with FSDPTrainer's constructor arguments."""
    return TRAINERS.get(cfg.backend)(cfg, spec, rank, world, **kw)


def data_parallel(trainer: Any, rank: int, world: int) -> tuple[int, int]:
    """(dp_size, dp_rank) a trainer takes its batch shard by: a backend with model
    parallelism (megatron TP) reports its own; otherwise every rank is a data-parallel rank."""
    return int(getattr(trainer, "dp_size", world)), int(getattr(trainer, "dp_rank", rank))
