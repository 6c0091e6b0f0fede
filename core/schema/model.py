"""Config section for the model subsystem (owned by the model code; see its field docs)."""

from __future__ import annotations

from dataclasses import dataclass

from miles.core.config import opt


@dataclass
class ModelConfig:
    enabled: bool = opt(True, "placeholder; replaced as the model section grows")
