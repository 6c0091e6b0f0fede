"""Config section for the engine subsystem (owned by the engine code; see its field docs)."""

from __future__ import annotations

from dataclasses import dataclass

from miles.core.config import opt


@dataclass
class EngineConfig:
    enabled: bool = opt(True, "placeholder; replaced as the engine section grows")
