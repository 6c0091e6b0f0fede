"""The same small run in sync, one_step_off and fully_async mode: real role processes, CPU engine.

The workload has long-tailed response lengths, so groups finish out of order and the
trainer often collects a batch piecemeal: the per-mode staleness bounds must hold anyway.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from .run_helpers import LONG_TAIL, SMALL, metrics, rollout_state, train

NAMES = [
    "rollout/fully_async/queue_size", "rollout/fully_async/aborted_groups_filtered",
    "rollout/fully_async/stale_groups_filtered", "rollout/fully_async/avg_staleness",
    "rollout/fully_async/max_staleness", "rollout/fully_async/buffer_avg_staleness",
    "rollout/fully_async/buffer_max_staleness", "rollout/fully_async/len_ratio",
    "rollout/fully_async/untrained_share", "rollout/fully_async/untrained_share/stale",
    "rollout/fully_async/untrained_share/failed",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("miles-cache")


# staleness bound each mode must keep (sync: every batch sampled by the weights it trains)
BOUND = {"sync": 0, "one_step_off": 1, "fully_async": 1}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_mode_small_run(mode: str, tmp_path: Path, cache: Path) -> None:
    run = tmp_path / "run"
    train(run, cache, {**LONG_TAIL, "buffer.mode": mode})
    steps, batch = int(SMALL["run.steps"]), int(SMALL["buffer.batch_groups"])
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        missing = [n for n in NAMES if n not in r]
        assert not missing, f"{mode}: step {r['step']} lacks {missing}"
        assert r["rollout/fully_async/max_staleness"] <= BOUND[mode], (mode, r)
    assert (run / "final_hf" / "config.json").is_file()

    state = rollout_state(run)
    led = state["buffer"]["ledger"]
    entries = {e["prompt_id"]: e for e in led["entries"]}
    # No prompt lost: every prompt the data stream handed out is in the ledger, in a known state.
    assert len(entries) == len(led["entries"]) == state["data"]["position"]
    assert {e["state"] for e in entries.values()} <= {"pending", "in_flight", "finished", "trained", "dropped"}
    pending = set(led["pending"])
    assert pending == {p for p, e in entries.items() if e["state"] == "pending"}
    # None trained twice: each weight version trained exactly one batch of distinct prompts.
    trained = [e for e in entries.values() if e["state"] == "trained"]
    assert Counter(e["trained_version"] for e in trained) == {v: batch for v in range(steps)}
    # The ledger agrees with the per-step metrics.
    assert state["buffer"]["totals"].get("groups_trained", 0) == steps * batch
    stale = sum(r["rollout/fully_async/stale_groups_filtered"] for r in rows)
    assert led["drop_events"].get("stale", 0) >= stale  # drops after the last step are in the ledger only
    if mode == "sync":
        assert all(r["rollout/fully_async/avg_staleness"] == 0 for r in rows)
    if mode != "one_step_off":  # sync by when work generates, fully_async by the deadline schedule
        assert stale == 0 and led["drop_events"].get("stale", 0) == 0
        assert rows[-1]["rollout/fully_async/untrained_share/stale"] == 0.0
