"""A launched run with a judge-scored reward: SIGKILL the judge engine mid-run (by PID, a role this
test's run started). The run keeps going to its last step; the supervisor restarts the judge; the
rewards that failed meanwhile are counted with their reason, none lost silently."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from .e2e_helpers import check_ledger, children, kill_tree, metrics, start_run, wait, wait_for

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]
# the tiny policy's own initial checkpoint as the judge (path ""): a fault drill needs a judge
# engine, not a good grader; short deadlines and no retry so the outage shows as failed rewards
# (with one retry, an idle machine restarted the judge inside the backoff and nothing failed)
JUDGE = ["--set", "reward_model.num_engines=1", "--set", "reward_model.max_new_tokens=2",
         "--set", "reward_model.live_wait_s=0.5", "--set", "reward_model.retries=0",
         "--set", "reward_model.timeout_s=10", "--set", "rollout.reward_fn=miles.rollout.rewards.judge_rewards:judge_correct",
         "--set", "reward_model.max_seq_len=512", "--set", "rollout.reward_errors=stop"]  # stop: the default; an outage must not trip it


def test_killed_judge_fails_rewards_counted_and_the_run_goes_on(tmp_path: Path, miles_cache: Path) -> None:
    # the session's MILES_CACHE: the FAST warm-up (the quick start's, the same hash as the other
    # FAST runs) is trained once a session, not again here
    run, cache = tmp_path / "run", miles_cache
    p = start_run(run, cache, "--set", "run.steps=14", *JUDGE)
    try:
        wait_for(lambda: len(metrics(run)) >= 3 or p.poll() is not None, 240, "step 3")
        assert p.poll() is None, (tmp_path / "run.launcher.log").read_text()[-3000:]
        (judge,) = children(p.pid, "miles.launch.role judge_engine")
        os.kill(judge, signal.SIGKILL)
        killed_at = len(metrics(run))
        assert wait(p, 300) == 0, (tmp_path / "run.launcher.log").read_text()[-3000:]
    finally:
        if p.poll() is None:
            kill_tree(p)
    log = (tmp_path / "run.launcher.log").read_text()
    assert "role_crashed_restarting" in log and "judge_engine" in log
    rows = metrics(run)
    assert [r["step"] for r in rows][-1] == 14 and killed_at < 14
    last = rows[-1]
    # the judge was down for a while: rewards failed, each counted with its reason, and the
    # guard's count of failed rewards is the judge client's count of failed calls
    failed = last["reward_model/failed"]
    assert failed >= 1, {k: v for k, v in last.items() if k.startswith("reward_model/")}
    assert last["rollout/reward_failed_JudgeUnavailable"] == failed
    assert sum(v for k, v in last.items() if k.startswith("reward_model/failed_")) == failed
    # every answered call gave a verdict; every call is answered, failed or still in flight
    verdicts = sum(v for k, v in last.items() if k.startswith("reward_model/verdict_"))
    assert verdicts == last["reward_model/ok"]
    assert 0 <= last["reward_model/calls"] - last["reward_model/ok"] - failed <= 64
    # the judge came back and judged again after the kill
    assert last["reward_model/live_engines"] == 1.0
    assert last["reward_model/ok"] > rows[killed_at - 1]["reward_model/ok"]
    # a failed reward fails its trajectory: its group is dropped (and retried) with a reason
    final = check_ledger(run)
    assert final["buffer"]["ledger"]["drop_events"].get("failed", 0) >= 1
