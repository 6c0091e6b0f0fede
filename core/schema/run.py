"""Run-wide config section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.core.config import opt


@dataclass
class RunConfig:
    name: str = opt("miles", "run name, bound to every log event")
    dir: str = opt("runs/latest", "directory the run writes metrics, checkpoints and plots to", "path")
    seed: int = opt(0, "global random seed")
    log_level: Literal["debug", "info", "warning", "error"] = opt("info", "log level")
    log_json: Literal["auto", "json", "console"] = opt(
        "auto", "log format: auto = JSON unless stderr is a TTY"
    )
