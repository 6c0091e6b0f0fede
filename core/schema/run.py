"""Run-wide config section."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from miles.core.config import opt
from miles.core.errors import ConfigError


@dataclass
class RunConfig:
    name: str = opt("miles", "run name, bound to every log event")
    dir: str = opt(
        "runs/latest", "directory the run writes metrics, checkpoints and plots to. Like every path option: "
        "relative in a config file = from that file's folder; relative in --set = from the working directory "
        "(so is this default)", "path")
    seed: int = opt(0, "global random seed")
    log_level: Literal["debug", "info", "warning", "error"] = opt("info", "log level")
    log_json: Literal["auto", "file", "json", "console"] = opt(
        "auto",
        "log format: file = JSON events to run_dir/logs/ (local launcher: only warnings and errors on "
        "the console, one readable line each); json = JSON on stderr; console = readable on stderr; "
        "auto = file",
    )
    steps: int = opt(20, "training steps (weight versions) the run makes", "steps")
    time_limit_s: float = opt(
        0.0, "stop at the first step boundary after this much training-loop time (from the loop's "
        "start: the step-0 evaluation and later ones included), even before `steps`; 0 = no limit; one trainer rank only", "s")
    warmup_sft_steps: int = opt(
        300, "supervised warm-up steps on the env's answers when no checkpoint is given; 0 = none", "steps"
    )
    warmup_lr: float = opt(3e-3, "learning rate of the supervised warm-up")
    progress: bool = opt(True, "print a one-line progress record per training step")
    wandb_project: str = opt(
        "", "Weights & Biases project the trainer logs metrics to; empty = off (pip install 'miles[wandb]')"
    )
    wandb_mode: Literal["online", "offline"] = opt(
        "online", "Weights & Biases mode: offline writes the run under run_dir/wandb/ for `wandb sync`"
    )

    def __post_init__(self) -> None:
        if self.log_json == "auto":
            self.log_json = "file"
        if self.time_limit_s < 0:
            raise ConfigError(f"run.time_limit_s = {self.time_limit_s}: must be >= 0 (0 = no limit)")

    @property
    def json_logs(self) -> bool | None:
        """`configure_logging`'s `json` for log_json: None under 'file' (the stream decides: JSON
        unless it is a terminal; a role's stderr is its file under run_dir/logs/)."""
        return None if self.log_json == "file" else self.log_json == "json"

    def launcher_log(self, run_dir: str | Path = "") -> Path | None:
        """Where a launcher or supervisor writes its events (run_dir/logs/launcher.log under
        'file', else None: stderr only); `run_dir` defaults to run.dir."""
        return Path(run_dir or self.dir) / "logs" / "launcher.log" if self.log_json == "file" else None
