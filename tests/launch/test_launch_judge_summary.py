"""The end-of-run table shows the judge pool's cost and failures when the run had one."""

from __future__ import annotations

import json

import pytest

from miles.launch.run_summary import format_table, summarize_run

pytestmark = pytest.mark.timeout(30)


def _write(tmp_path, rows) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_judge_row_from_the_last_step(tmp_path) -> None:
    base = {"rollout/reward_mean": 0.5, "perf/step_time_s": 2.0}
    judge = {"reward_model/calls": 40.0, "reward_model/ok": 30.0, "reward_model/failed": 10.0,
             "reward_model/failed_no_live_judge": 7.0, "reward_model/failed_timeout": 3.0,
             "reward_model/mean_call_s": 0.25, "reward_model/time_s": 10.0}
    _write(tmp_path, [{"step": 1, **base, **judge, "reward_model/calls": 20.0},
                      {"step": 2, **base, **judge}])
    s = summarize_run(tmp_path)
    assert s.judge["calls"] == 40.0
    row = next(ln for ln in format_table(s).splitlines() if ln.startswith("judge (reward_model)"))
    assert "40 calls, 10 failed (no_live_judge 7, timeout 3), 0.250 s/call, 5.00 judge-s per step" in row


def test_no_judge_row_without_a_pool(tmp_path) -> None:
    _write(tmp_path, [{"step": 1, "rollout/reward_mean": 0.5, "perf/step_time_s": 2.0}])
    assert "judge (reward_model)" not in format_table(summarize_run(tmp_path))
