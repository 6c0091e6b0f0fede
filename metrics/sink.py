"""Metrics sinks: one JSON object per step in metrics.jsonl, TensorBoard when installed,
Weights & Biases when configured (`run.wandb_project`, the `wandb` extra)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.core.logging import get_logger

log = get_logger("miles.metrics")


@dataclass
class WandbSettings:
    project: str
    mode: str = "online"  # "offline": files under <run_dir>/wandb/, no network
    name: str = ""
    config: dict[str, Any] = field(default_factory=dict)


class MetricsSink:
    """Appends step records to `<dir>/metrics.jsonl`; mirrors scalars to TensorBoard if available
    and to a Weights & Biases run when `wandb` settings are given."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, wandb: WandbSettings | None = None,
                 resume_step: int | None = None) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        _drop_torn_tail(self.path)  # a resumed run must not append onto a killed run's fragment
        if resume_step is not None:  # the steps after the checkpoint run again (metrics/run_dir.py)
            from miles.metrics.run_dir import truncate_step_records

            truncate_step_records(self.dir, resume_step)
        self._f = self.path.open("a")
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.info("tensorboard_unavailable", hint="pip install 'miles[tb]' for event files")
            else:
                # event files are append-only: on resume, TensorBoard hides the events of the
                # steps past the checkpoint (written again now) instead
                self._tb = SummaryWriter(str(self.dir / "tb"),
                                         purge_step=None if resume_step is None else resume_step + 1)
        self._wandb: Any = None
        if wandb is not None:
            import wandb as wb  # checked at launch (launch/validate.py)

            self._wandb = wb.init(project=wandb.project, name=wandb.name or None, mode=wandb.mode,
                                  dir=str(self.dir), config=wandb.config, reinit="create_new")

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: _jsonable(v) for k, v in record.items()}
        self._f.write(json.dumps(clean) + "\n")
        self._f.flush()
        if self._tb is not None:
            # one event holding every scalar of the step (what add_scalar writes, ~60 times over:
            # ~2 ms of the trainer's CPU per step)
            from tensorboard.compat.proto.summary_pb2 import Summary

            values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in clean.items()
                      if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)]
            self._tb._get_file_writer().add_summary(Summary(value=values), int(record.get("step", 0)))
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in clean.items() if k != "step" and isinstance(v, int | float)
                             and not isinstance(v, bool)}, step=int(record.get("step", 0)))

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line that has no newline (a write cut short by kill -9) off the file."""
    if not path.exists():
        return
    with path.open("rb+") as f:
        size = f.seek(0, 2)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        # Walk back to the previous newline; small reads, the tail is one record at most.
        pos = size
        while pos > 0:
            step = min(4096, pos)
            f.seek(pos - step)
            chunk = f.read(step)
            i = chunk.rfind(b"\n")
            if i >= 0:
                pos = pos - step + i + 1
                break
            pos -= step
        f.truncate(pos)
    log.warning("metrics_torn_line_dropped", path=str(path), bytes=size - pos)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl; a torn last line (a killed writer) is skipped.

    A bad line elsewhere is skipped too and logged with its number: one damaged record
    must not hide the rest of a run.
    """
    p = Path(path)
    if not p.exists():
        return []
    out: list[dict[str, Any]] = []
    lines = p.read_bytes().split(b"\n")
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            rec = json.loads(ln)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            last = i == len(lines) - 1  # no newline after it: the write was cut short
            log.warning("metrics_line_skipped", path=str(p), line=i + 1, torn=last, error=str(exc))
            continue
        if isinstance(rec, dict):
            out.append(rec)
        else:
            log.warning("metrics_line_skipped", path=str(p), line=i + 1, error="not a JSON object")
    return out
