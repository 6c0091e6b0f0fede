"""Each CPU transport runs a small sweep end to end between two real processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from .perftest_helpers import SMALL, check_outputs, perftest

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("transport", "pattern"), [
    ("zmq-ctl", "pingpong"),
    ("zmq-bulk", "stream"),
    ("broadcast", "bucket"),
    ("disk", "stream"),
])
def test_small_sweep_end_to_end(tmp_path: Path, transport: str, pattern: str) -> None:
    j, c = tmp_path / "out.json", tmp_path / "out.csv"
    res = perftest("--transport", transport, "--pattern", pattern, *SMALL, "--json", str(j), "--csv", str(c),
                   cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = check_outputs(j, c, transport, pattern, [8, 512, 32768])
    assert all(r["window"] == (1 if pattern == "pingpong" else 4) for r in rows)
    assert "x raw" in res.stdout and "32KiB" in res.stdout
