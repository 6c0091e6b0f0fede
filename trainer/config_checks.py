"""What the trainer checks of its config at start: only what the loader cannot know (how many
ranks were started), plus `trainer.compile` resolved for the device and model. The config's own
values were checked when it was loaded (core/schema/trainer.py, core/schema/resolve.py).

Kept free of torch so the launcher can import it.
"""

from __future__ import annotations

from miles.core.errors import ConfigError
from miles.core.schema.trainer import TrainerConfig


def check_world(cfg: TrainerConfig, world: int) -> None:
    """The ranks started agree with trainer.world_size (0 there: any count)."""
    if world < 1 or (cfg.world_size and world != cfg.world_size):
        raise ConfigError(f"trainer.world_size={cfg.world_size} but {world} ranks were started")


def compile_enabled(cfg: TrainerConfig, device_type: str, is_moe: bool) -> bool:
    """`trainer.compile` resolved: auto compiles only where it measured faster (a dense model
    on CUDA) and never under true-on-policy, whose invariant kernels replace the block ops."""
    if cfg.compile == "auto":
        return device_type == "cuda" and not is_moe and not cfg.true_on_policy
    return cfg.compile == "on"
