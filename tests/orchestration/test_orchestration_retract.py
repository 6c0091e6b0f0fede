"""Weight updates in pause mode 'retract': retracted requests continue under the new version.

The untrained policy rarely stops early, and with no staleness bound and a deep queue
generation never waits for the trainer, so the engine is busy whenever an update
arrives (64-token answers and 6 updates: with 32 and 4, a loaded CI machine once saw
only retracted requests that had not been fed yet, which carry no tokens of the old version):
requests are
retracted mid-generation, resubmitted as prompt + partial output, and finish with
tokens from two versions. Without resubmission they would come back aborted and
their groups would be dropped as failed. Routing replay is on, so retracted requests that
were queued but never fed must come back with an empty routing array, not an error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .run_helpers import metrics, rollout_state, train


@pytest.mark.timeout(150)
def test_retract_resubmits_under_new_version(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    run = tmp_path / "run"
    train(run, tmp_path_factory.mktemp("miles-cache"), {
        "buffer.mode": "fully_async", "sync.pause_mode": "retract", "rollout.max_new_tokens": "64",
        "buffer.max_waiting": "500", "buffer.max_staleness": "-1", "run.steps": "6",
    })
    rows = metrics(run)
    last = rows[-1]
    assert last["rollout/retracted_resubmits"] > 0, "no request was retracted by a weight update"
    assert last["rollout/mixed_version_samples"] > 0, "no sample records tokens from two versions"
    assert sum(r["rollout/fully_async/aborted_groups_filtered"] for r in rows) == 0
    ledger = rollout_state(run)["buffer"]["ledger"]
    assert ledger["drop_events"].get("failed", 0) == 0, ledger["drop_events"]
