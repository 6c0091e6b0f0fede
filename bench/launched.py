"""A launched `miles train` run as a user starts it, for the benches that measure one: this
interpreter (no miles.sh: the H200 image has no virtualenv of miles), the config plus `--set`
overrides, run from the repository; a failed run stops the bench with its output's tail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def train(config: str | Path, sets: list[str], what: str = "miles train",
          env: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], float]:
    """Run it (`sets` must name run.dir); returns its metrics.jsonl rows and the wall time in s."""
    cmd = [sys.executable, "-m", "miles.launch.cli", "train", str(config), *[x for s in sets for x in ("--set", s)]]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env or dict(os.environ))
    wall = time.monotonic() - t0
    if p.returncode:
        raise SystemExit(f"{what} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    run_dir = next(s.split("=", 1)[1] for s in sets if s.startswith("run.dir="))
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return rows, wall
