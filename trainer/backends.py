"""Trainer backends by `trainer.backend` tag, and the launch-time checks of the trainer's settings
(the chosen backend; LoRA's needs of the engine and the sync channel).

Entries are import paths, so megatron-core is imported only when 'megatron' is chosen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles.core.errors import ConfigError
from miles.core.hooks import Registry
from miles.core.schema import MilesConfig
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


def check_backend(cfg: TrainerConfig, spec: ModelSpec | None, asynchronous: bool, world: int) -> None:
    """Launch-time checks of `cfg.backend`; ConfigError naming the field (megatron: also
    that megatron-core can run here)."""
    if cfg.backend == "megatron":
        from miles.trainer.megatron.available import require_megatron
        from miles.trainer.megatron.trainer import check_megatron_config

        require_megatron()  # first: no config can make megatron run where it cannot
        if cfg.device == "cpu":
            raise ConfigError("trainer.backend='megatron' needs trainer.device = 'cuda' or 'auto'")
        if cfg.recompute != "off":
            raise ConfigError(f"trainer.recompute={cfg.recompute!r} is the FSDP backend's block checkpointing; "
                              "the megatron backend does not map it to megatron-core's recompute yet: set 'off'")
        check_megatron_config(cfg, spec, asynchronous, world)
        return
    from miles.trainer.config_checks import check_trainer_config

    check_trainer_config(cfg, asynchronous, world)


def make_trainer(cfg: TrainerConfig, spec: ModelSpec, rank: int, world: int, **kw: Any) -> Any:
    """The backend's trainer class instantiated with FSDPTrainer's constructor arguments."""
    return TRAINERS.get(cfg.backend)(cfg, spec, rank, world, **kw)


def data_parallel(trainer: Any, rank: int, world: int) -> tuple[int, int]:
    """(dp_size, dp_rank) a trainer takes its batch shard by: a backend with model
    parallelism (megatron TP) reports its own; otherwise every rank is a data-parallel rank."""
    return int(getattr(trainer, "dp_size", world)), int(getattr(trainer, "dp_rank", rank))


def check_lora_launch(cfg: MilesConfig) -> None:
    """Launch checks of the weight hand-off. A sharded sync (FSDP2 shards or megatron's
    tensor-/expert-parallel slices) needs no whole-model snapshot; LoRA runs sync only adapters (+ their scale) and the engines merge
    them: the engine and the channel must carry them as sent. Raises ConfigError naming the option."""
    if cfg.sync.sharded and cfg.eval.mode == "snapshot":
        raise ConfigError("sync.sharded: eval.mode = 'snapshot' needs the whole model on rank 0; use 'shared' "
                          "or 'external'")
    if cfg.trainer.lora.rank < 1:
        return
    if cfg.sync.sharded:
        raise ConfigError("trainer.lora.rank > 0 sends adapters, not shards: set sync.sharded = false")
    if cfg.engine.type != "torch":
        raise ConfigError(f"trainer.lora.rank > 0 needs engine.type = 'torch' (it merges synced adapters); "
                          f"got {cfg.engine.type!r}")
    if cfg.sync.transport == "disk_delta":
        raise ConfigError("trainer.lora.rank > 0: sync.transport = 'disk_delta' diffs full weights; "
                          "adapters are small, use zmq, broadcast or cuda_ipc")
    if cfg.sync.dtype not in ("same", "float32"):
        raise ConfigError(f"trainer.lora.rank > 0 needs sync.dtype = 'same' or 'float32' (the adapter scale "
                          f"travels as a number), got {cfg.sync.dtype!r}")
