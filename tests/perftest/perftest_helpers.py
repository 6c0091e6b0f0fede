"""Running `miles perftest` as a real command (two real processes) from tests."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from miles.transport.perf.report import COLUMNS

SMALL = ["--sizes", "8B:32KiB:x64", "--iters", "24", "--warmup", "4", "--window", "4", "--timeout", "20",
         "--connect-timeout", "20"]


def perftest(*args: str, cwd: Path, timeout: float = 50, env: dict[str, str] | None = None,
             prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [*(prefix or []), sys.executable, "-m", "miles.launch.cli", "perftest", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def check_outputs(json_path: Path, csv_path: Path, transport: str, pattern: str, sizes: list[int]) -> list[Any]:
    """Both files parse, every row has every column, figures are positive and consistent."""
    doc = json.loads(json_path.read_text())
    rows = doc["rows"]
    assert [r["size_bytes"] for r in rows] == sizes
    for r in rows:
        assert set(r) == set(COLUMNS), set(COLUMNS) ^ set(r)
        assert r["transport"] == transport and r["pattern"] == pattern
        for k in ("p50_us", "gbps", "msgs_per_s", "raw_p50_us", "raw_gbps", "limit_gbps", "ratio_raw",
                  "ratio_limit"):
            assert r[k] > 0, (k, r)
        assert r["p50_us"] <= r["p99_us"] <= r["max_us"]
        assert abs(r["ratio_raw"] - r["gbps"] / r["raw_gbps"]) < 1e-3 * r["ratio_raw"] + 1e-9
        assert abs(r["gbps"] - r["size_bytes"] * r["msgs_per_s"] / 1e9) < 1e-3 * r["gbps"] + 1e-9
    with open(csv_path, newline="") as f:
        crow = list(csv.DictReader(f))
    assert len(crow) == len(rows)
    for c in crow:
        assert list(c) == COLUMNS
        assert all(c[k] != "" for k in COLUMNS if k not in ("h2d_gbps", "d2h_gbps")), c
    return rows
