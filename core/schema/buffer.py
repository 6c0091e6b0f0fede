"""Config section for the buffer subsystem (owned by the buffer code; see its field docs)."""

from __future__ import annotations

from dataclasses import dataclass

from miles.core.config import opt


@dataclass
class BufferConfig:
    enabled: bool = opt(True, "placeholder; replaced as the buffer section grows")
