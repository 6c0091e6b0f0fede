"""What a launch may do with its run directory: one run per directory, never two mixed.

- A fresh run (no `--resume`) starts only in an absent or empty directory. Anything else is
  refused before a file is written, with the two ways on: `--resume DIR`, or another `run.dir`.
  (Refused rather than numbered sub-runs: the path a user gave stays the path of the run, and
  scripts that read `DIR/metrics.jsonl` afterwards read the run they started.)
- A resume continues from the newest checkpoint, so every step-indexed record written after
  that checkpoint's step is dropped before the roles start: rows of `metrics.jsonl` and
  `eval.jsonl` are cut (the resumed steps write them again), and TensorBoard, whose event files
  are append-only, is told to hide the events from that step on (`SummaryWriter(purge_step=)`,
  `MetricsSink(resume_step=)`). Weights & Biases keeps its own history: a resumed run is a new
  W&B run.
- Resuming a run that has finished every step of `run.steps` has nothing to do: it says so
  and launches nothing (`--set run.steps=N` with a larger N trains further).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from miles.core.errors import ConfigError
from miles.core.files import atomic_write_bytes

if TYPE_CHECKING:
    from miles.core.schema import MilesConfig
    from miles.core.schema.trainer import TrainerConfig

STEP_RECORDS = ("metrics.jsonl", "eval.jsonl")  # one JSON object per line, each with its "step"


def resume_command(run_dir: str | Path) -> str:
    """The command that continues the run in `run_dir`, as the user can paste it where they are:
    the program they started (`./miles.sh` sets MILES_PROG; else `miles`), the directory relative
    to the working directory when it lies below it."""
    d = Path(run_dir).absolute()
    try:
        shown = str(d.relative_to(Path.cwd()))
    except ValueError:
        shown = str(d)
    return f"{os.environ.get('MILES_PROG') or 'miles'} train --resume {shlex.quote(shown)}"


def latest_checkpoint_step(run_dir: str | Path) -> int | None:
    """The step of the run's newest complete checkpoint (its `latest` pointer), None without one."""
    ptr = Path(run_dir) / "checkpoints" / "latest"
    if not ptr.is_file():
        return None
    m = re.fullmatch(r"step_(\d+)", ptr.read_text().strip())
    return int(m.group(1)) if m else None


def check_fresh(run_dir: str | Path) -> None:
    """Refuse a fresh run into a directory that already holds something (another run's files)."""
    d = Path(run_dir)
    if d.is_dir() and any(d.iterdir()):
        raise ConfigError(
            f"run.dir {str(d)!r} is not empty (an earlier run's files): continue that run with "
            f"`{resume_command(d)}`, or start a new one with --set run.dir=NEW_DIR (or delete it)")
    if d.exists() and not d.is_dir():
        raise ConfigError(f"run.dir {str(d)!r} is a file, not a directory")


def checkpoint_step(ckpt: str | Path) -> int:
    """The step a checkpoint directory (`checkpoints/step_000120`) was written after."""
    m = re.fullmatch(r"step_(\d+)", Path(ckpt).name)
    if m is None:
        raise ConfigError(f"checkpoint {str(ckpt)!r}: not a step_NNNNNN directory")
    return int(m.group(1))


def last_step(run_dir: str | Path) -> int:
    """The highest step metrics.jsonl records (0 when it has none)."""
    top = 0
    for rec in _records(Path(run_dir) / "metrics.jsonl"):
        top = max(top, _step(rec))
    return top


def finished_at(run_dir: str | Path, steps: int) -> int | None:
    """The step a finished run ended at, when it ended (its final state is written) having done
    all `steps`; None otherwise."""
    d = Path(run_dir)
    if not (d / "rollout_final.json").is_file():
        return None
    top = last_step(d)
    return top if top >= steps else None


def truncate_step_records(run_dir: str | Path, step: int) -> dict[str, int]:
    """Drop the rows past `step` from the run's step-indexed files; returns rows dropped per file.
    A torn or unreadable line goes too (it can only be the killed run's last write)."""
    dropped: dict[str, int] = {}
    for name in STEP_RECORDS:
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        lines = path.read_bytes().split(b"\n")
        keep = [ln for ln in lines if ln.strip() and _keeps(ln, step)]
        n = sum(1 for ln in lines if ln.strip()) - len(keep)
        if n:
            atomic_write_bytes(path, b"".join(ln + b"\n" for ln in keep))
            dropped[name] = n
    return dropped


def _keeps(line: bytes, step: int) -> bool:
    try:
        rec = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(rec, dict) and _step(rec) <= step


def _step(rec: dict[str, object]) -> int:
    step = rec.get("step", 0)
    try:
        return int(step) if isinstance(step, int | float | str) else 0
    except (TypeError, ValueError):
        return 0


def _records(path: Path) -> list[dict[str, object]]:
    if not path.is_file():
        return []
    out = []
    for ln in path.read_bytes().split(b"\n"):
        try:
            rec = json.loads(ln) if ln.strip() else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def write_config(run_dir: str | Path, cfg: MilesConfig) -> Path:
    """The run's resolved config (a `MilesConfig`): config.resolved.json, which the roles and
    `--resume` load, and the documented TOML beside it. Each file is replaced whole: trainer rank 0
    rewrites them with its machine's values (`record_trainer`) while other roles may be reading."""
    from miles.core.config import dump_toml, to_dict

    run = Path(run_dir)
    path = run / "config.resolved.json"
    atomic_write_bytes(path, json.dumps(to_dict(cfg), indent=1).encode())
    atomic_write_bytes(run / "config.resolved.toml", dump_toml(cfg, with_docs=True).encode())
    return path


def record_trainer(cfg: MilesConfig, trainer_cfg: TrainerConfig, write: bool) -> MilesConfig:
    """`cfg` with the trainer section as a trainer rank resolved it for its device
    (core/schema/runtime.py); with `write` (rank 0) written over the launcher's run-dir config
    where it differs, so the run directory shows what each 'auto' became (a launched run only:
    one whose directory holds that config)."""
    import dataclasses

    resolved = dataclasses.replace(cfg, trainer=trainer_cfg)
    launched = (Path(cfg.run.dir) / "config.resolved.json").is_file()
    if write and launched and resolved.trainer != cfg.trainer:
        write_config(cfg.run.dir, resolved)
    return resolved
