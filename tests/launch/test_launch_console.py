"""The launcher's console: progress lines with ETA, warnings as one readable line, logs to files."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.launch.console import REPEATS_SHOWN, Console
from miles.launch.run_summary import format_table, summarize_run
from miles.metrics.progress import progress_line
from miles.metrics.sink import MetricsSink

pytestmark = pytest.mark.timeout(60)


def _row(step: int, **extra: float) -> dict[str, float]:
    return {"step": step, "rollout/reward_mean": 0.1 * step, "perf/step_time_s": 0.1, "perf/sync_s": 0.012,
            "rollout/fully_async/avg_staleness": 1.5, "train/tokens": 100.0, **extra}


def _event(level: str, event: str, role: str = "engine", **kw: object) -> str:
    return json.dumps({"event": event, "level": level, "role": role, "rank": 0, "run": "t",
                       "timestamp": "2026-01-01T00:00:00Z", **kw})


def test_progress_line_shows_step_eta_sync_and_len_ratio() -> None:
    line = progress_line(_row(30, **{"rollout/fully_async/len_ratio": 0.91}), 120, [0.5, 0.7], 10.0, 20)
    assert line.startswith("step  30/120  25%")
    assert "reward 3.000 (avg10 0.600)" in line and "sync 12ms" in line and "len_ratio 0.91" in line
    assert "ETA 0:45" in line  # 90 steps left at 2 steps/s
    assert "\n" not in line
    assert "len_ratio" not in progress_line(_row(1), 10, [0.1], 0.0, 0)


def test_progress_line_survives_none_and_nan_metrics() -> None:
    # metrics.jsonl holds None where a value was NaN or inf (the step that went non-finite)
    row = _row(5, **{"train/train_rollout_logprob_abs_diff": None, "rollout/reward_mean": float("nan"),
                     "train/tokens_per_s": float("inf"), "perf/sync_s": None, "train/skipped_nonfinite": 1.0,
                     "eval/reward_mean": None, "eval/greedy_accuracy": None, "eval/samples": 4,
                     "eval/avg_at_4": None})
    line = progress_line(row, 10, [float("nan"), 0.5], 1.0, 1)
    assert "Δlogp n/a" in line and "reward n/a" in line and "tok/s n/a" in line and "sync n/a |" in line
    assert "SKIPPED 1 non-finite update(s)" in line and "greedy n/a avg@4 n/a" in line
    assert "(avg10 0.500)" in line  # a NaN reward stays out of the moving average
    # the step-0 evaluation reported on step 1's row is eval@0, not eval@1
    assert "eval@0 greedy 0.500" in progress_line(_row(1, **{"eval/step": 0, "eval/reward_mean": 0.5}), 10, [0.1], 1.0, 1)


def test_eta_of_rows_read_in_one_poll_is_not_zero(tmp_path: Path) -> None:
    """Steps 1-3 land between two polls (wall time between them ~0): the ETA of step 2 and 3
    comes from the steps' own times (0.1 s each: 97 steps left ~ 0:10), not an infinite rate."""
    sink = MetricsSink(tmp_path, tensorboard=False)
    out = io.StringIO()
    con = Console(tmp_path, 100, out=out)
    for step in (1, 2, 3):
        sink.write(_row(step))
    con.poll()
    etas = [ln.rsplit("ETA ", 1)[1] for ln in out.getvalue().splitlines()]
    assert etas[0] == "0:10" and etas[1] == "0:10" and etas[2] == "0:10", etas
    sink.close()


def test_console_follows_metrics_and_role_logs(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    sink = MetricsSink(tmp_path, tensorboard=False)
    out = io.StringIO()
    con = Console(tmp_path, 4, out=out)
    sink.write(_row(1))
    log = (tmp_path / "logs" / "engine-0.log").open("a")
    log.write(_event("info", "engine_ready") + "\n")
    log.write(_event("warning", "event_loop_lag", lag_ms=1500.0) + "\n")
    for i in range(REPEATS_SHOWN + 2):
        log.write(_event("warning", "slow_request", request=i, detail="a\nb") + "\n")
    log.write(_event("error", "boom", error="it broke") + "\n")
    log.write('{"event": "half a line')  # not yet complete: not read until its newline lands
    log.flush()
    con.poll()
    sink.write(_row(2))
    log.write('", "level": "error", "role": "rollout"}\n')
    log.flush()
    con.poll()
    lines = out.getvalue().splitlines()
    assert [ln.split(" |")[0] for ln in lines if ln.startswith("step")] == ["step 1/4  25%", "step 2/4  50%"]
    warn = [ln for ln in lines if not ln.startswith("step")]
    assert warn[0] == "warning [engine-0] slow_request: request=0 detail=a b"
    assert len([w for w in warn if "slow_request:" in w]) == REPEATS_SHOWN
    assert any("further 'slow_request'" in w for w in warn)
    assert "error [engine-0] boom: error=it broke" in warn
    assert "error [rollout] half a line" in warn
    assert not any("event_loop_lag" in w or "engine_ready" in w or w.startswith("{") for w in warn)
    assert con.counted == {"event_loop_lag": 1}
    sink.close()


def test_a_reused_run_directory_shows_only_the_new_lines(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    sink = MetricsSink(tmp_path, tensorboard=False)
    sink.write(_row(1))
    (tmp_path / "logs" / "engine-0.log").write_text(_event("warning", "old_news") + "\n")
    out = io.StringIO()
    con = Console(tmp_path, 4, out=out)  # as a resumed launch starts
    sink.write(_row(2))
    with (tmp_path / "logs" / "engine-0.log").open("a") as f:
        f.write(_event("warning", "fresh") + "\n")
    con.poll()
    sink.close()
    lines = out.getvalue().splitlines()
    assert [ln.split(" |")[0] for ln in lines if ln.startswith("step")] == ["step 2/4  50%"]
    assert [ln for ln in lines if not ln.startswith("step")] == ["warning [engine-0] fresh"]


def test_log_file_gets_json_console_gets_readable_warnings(tmp_path: Path) -> None:
    code = (
        "from miles.core.logging import configure_logging, get_logger\n"
        f"configure_logging('info', None, file={str(tmp_path / 'logs' / 'l.log')!r}, run='r', role='launcher')\n"
        "log = get_logger('x')\n"
        "log.info('role_started', pid=1)\n"
        "log.warning('event_loop_lag', lag_ms=12.5)\n"
        "log.error('trainer_exited', code=1, cause='Boom: multi\\nline')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines() == ["warning [launcher] event_loop_lag: lag_ms=12.5",
                                     "error [launcher] trainer_exited: code=1 cause=Boom: multi line"]
    events = [json.loads(ln) for ln in (tmp_path / "logs" / "l.log").read_text().splitlines()]
    assert [e["event"] for e in events] == ["role_started", "event_loop_lag", "trainer_exited"]
    assert events[2]["cause"] == "Boom: multi\nline" and events[0]["run"] == "r"


def test_summary_table_names_reward_drops_sync_and_outputs(tmp_path: Path) -> None:
    sink = MetricsSink(tmp_path, tensorboard=False)
    for s in range(1, 9):
        sink.write(_row(s, **{"rollout/response_len_mean": 3.0}))
    sink.close()
    (tmp_path / "rollout_final.json").write_text(json.dumps({"buffer": {
        "totals": {"groups_started": 30, "groups_trained": 16},
        "ledger": {"entries": [{"state": "trained"}] * 16, "retried": 2, "dropped_by_reason": {"stale": 1},
                   "drop_events": {"stale": 12, "aborted": 2}}}}))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rollout-0.log").write_text(_event("warning", "event_loop_lag") + "\n")
    s = summarize_run(tmp_path)
    assert s.steps == 8 and s.reward == pytest.approx((0.15, 0.75))
    table = format_table(s)
    assert "0.150 -> 0.750 (+0.600)" in table
    assert "aborted 2, stale 12" in table and "30 / 16" in table
    assert "median 12.0 ms" in table and "10.00 steps/s" in table
    assert "warning event_loop_lag x1" in table and str(tmp_path) in table


def test_console_says_when_the_engine_compiles_its_decode(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    out = io.StringIO()
    con = Console(tmp_path, 4, out=out)
    with (tmp_path / "logs" / "engine-0.log").open("a") as log:
        log.write(_event("info", "engine_warmed_up", seconds=0.4, compiled=False, compiling_in_background=True) + "\n")
        log.write(_event("info", "decode_compile_started") + "\n")
        log.write(_event("info", "decode_compile_ready", compile_s=51.2, swap_s=1.1, compiled=True) + "\n")
        log.write(_event("info", "engine_ready") + "\n")
    con.poll()
    assert out.getvalue().splitlines() == [
        "engine-0: compiling the decode graphs in the background; serving with uncompiled graphs meanwhile",
        "engine-0: decode compile ready after 51.2 s; serving compiled decode graphs"]
