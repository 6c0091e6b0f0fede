"""Config section for the rollout subsystem (owned by the rollout code; see its field docs)."""

from __future__ import annotations

from dataclasses import dataclass

from miles.core.config import opt


@dataclass
class RolloutConfig:
    enabled: bool = opt(True, "placeholder; replaced as the rollout section grows")
