"""Config section for the sync subsystem (owned by the sync code; see its field docs)."""

from __future__ import annotations

from dataclasses import dataclass

from miles.core.config import opt


@dataclass
class SyncConfig:
    enabled: bool = opt(True, "placeholder; replaced as the sync section grows")
