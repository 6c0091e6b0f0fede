"""A launched run whose 2 FSDP trainer ranks each send their own shard to the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from .e2e_helpers import check_ledger, kill_tree, metrics, start_run, wait

pytestmark = [pytest.mark.timeout(400)]


def test_two_ranks_send_their_shards_and_the_engine_serves_the_trained_weights(tmp_path: Path, miles_cache: Path) -> None:
    """sync mode: step 2 trains on rollouts sampled entirely with version 1, which reached the
    engine only through the sharded sync. If a byte were wrong or missing, the trainer's
    logprobs (R3 replayed, fp32) would not match the engine's."""
    run = tmp_path / "run"
    p = start_run(run, miles_cache, "--set", "run.steps=2", "--set", "trainer.world_size=2",
                  "--set", "sync.sharded=true", "--set", "buffer.mode=sync")
    try:
        assert wait(p, 360) == 0, (tmp_path / "run.launcher.log").read_text()[-3000:]
    finally:
        if p.poll() is None:
            kill_tree(p)
    rows = metrics(run)
    assert [r["version"] for r in rows] == [1, 2]
    assert all(r["sync/bytes"] > 0 and r["sync/plan_declined"] == 0 for r in rows)
    assert rows[1]["train/train_rollout_logprob_abs_diff"] < 1e-4, rows[1]
    check_ledger(run)
