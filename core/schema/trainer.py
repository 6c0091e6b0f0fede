"""Config section for the trainer subsystem (owned by the trainer code; see its field docs)."""

from __future__ import annotations

from dataclasses import dataclass

from miles.core.config import opt


@dataclass
class TrainerConfig:
    enabled: bool = opt(True, "placeholder; replaced as the trainer section grows")
