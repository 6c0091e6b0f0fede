"""What the trainer checks of its config at start: only what the loader cannot know (how many
ranks were started). The config's own values were checked when it was loaded
(core/schema/trainer.py, core/schema/resolve.py), and its machine-dependent ones resolved at the
trainer's start (core/schema/runtime.py).

Kept free of torch so the launcher can import it.
"""

from __future__ import annotations

from miles.core.errors import ConfigError
from miles.core.schema.trainer import TrainerConfig


def check_world(cfg: TrainerConfig, world: int) -> None:
    """The ranks started agree with trainer.world_size (0 there: any count)."""
    if world < 1 or (cfg.world_size and world != cfg.world_size):
        raise ConfigError(f"trainer.world_size={cfg.world_size} but {world} ranks were started")

