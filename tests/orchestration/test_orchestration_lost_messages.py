"""A run whose every `rollout.SetVersion` is lost (transport.faults) still finishes, in sync mode too.

Sync mode opens a version's groups only once the rollout side knows that version; it learned it
only from SetVersion, a tell, so one lost announcement stalled generation until the trainer's
pull deadline. The trainer's PullBatch carries its version: the rollout side now takes it from there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .run_helpers import metrics, train


@pytest.mark.timeout(150)
def test_sync_run_finishes_with_every_set_version_lost(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    run = tmp_path / "run"
    train(run, tmp_path_factory.mktemp("miles-cache"), {
        "buffer.mode": "sync", "run.log_level": "info",
        "transport.faults.drop_rate": "1.0", "transport.faults.drop_types": '["rollout.SetVersion"]'}, timeout=100)
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/fully_async/max_staleness"] == 0 for r in rows)  # sync's bound still holds
    lines = (run / "logs" / "trainer-0.log").read_text().splitlines()
    drops = [json.loads(ln) for ln in lines if '"message_dropped"' in ln]
    assert len(drops) >= 3 and {d["message"] for d in drops} == {"tell:rollout.SetVersion"}
