"""Metrics sinks: one JSON object per step in metrics.jsonl, TensorBoard when installed."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from miles.core.logging import get_logger

log = get_logger("miles.metrics")


class MetricsSink:
    """Appends step records to `<dir>/metrics.jsonl`; mirrors scalars to TensorBoard if available."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._f = self.path.open("a")
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.info("tensorboard_unavailable", hint="pip install 'miles[tb]' for event files")
            else:
                self._tb = SummaryWriter(str(self.dir / "tb"))

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: _jsonable(v) for k, v in record.items()}
        self._f.write(json.dumps(clean) + "\n")
        self._f.flush()
        if self._tb is not None:
            step = int(record.get("step", 0))
            for k, v in clean.items():
                if k != "step" and isinstance(v, int | float) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    return [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()] if p.exists() else []
