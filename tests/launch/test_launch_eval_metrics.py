"""Held-out evaluation numbers: pass@k, the console's eval part, the run summary and report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from miles.actors.evaluator import pass_at_k
from miles.launch.report import render_html
from miles.launch.run_summary import format_table, read_evals, summarize_run
from miles.metrics.progress import eval_part

pytestmark = pytest.mark.timeout(60)


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(0, 8, 8) == 0.0 and pass_at_k(1, 8, 8) == 1.0
    assert math.isclose(pass_at_k(1, 8, 1), 1 / 8)
    assert math.isclose(pass_at_k(2, 4, 2), 1 - 1 / 6)  # C(2,2)/C(4,2) left without a right one


def ev(step: int, greedy: float) -> dict[str, float]:
    return {"step": step, "eval/reward_mean": greedy, "eval/greedy_accuracy": greedy, "eval/samples": 8.0,
            "eval/avg_at_8": greedy / 2, "eval/pass_at_8": min(1.0, greedy * 3), "eval/step": float(step),
            "eval/loop_s": 10.0 * step}


def test_console_summary_and_report_show_the_evaluations(tmp_path: Path) -> None:
    assert eval_part(ev(20, 0.25)) == "eval@20 greedy 0.250 avg@8 0.125 pass@8 0.750"
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "rollout/reward_mean": 0.1 * s, "perf/step_time_s": 1.0,
                    "train/train_rollout_logprob_abs_diff": 0.01}) + "\n" for s in range(1, 11)))
    (run / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [ev(10, 0.5), ev(0, 0.125),
                                                                          {"step": 5, "eval/failed": 1.0}]))
    assert [e["step"] for e in read_evals(run)] == [0, 10]  # step order, the failed one left out
    table = format_table(summarize_run(run))
    assert "held-out eval, step 0" in table and "greedy 0.125, avg@8 0.062, pass@8 0.375" in table
    assert "held-out eval, step 10" in table and "greedy 0.500" in table
    page = render_html(run)
    assert "held-out evaluation" in page and "9-step moving average" in page
    assert "|logp engine - logp trainer| per step" in page


def test_strict_lenient_and_all_rows_in_the_line_and_the_table(tmp_path: Path) -> None:
    e = {**ev(0, 0.25), "eval/accuracy_strict": 0.2, "eval/accuracy_lenient": 0.3,
         "eval/full/num_prompts": 1319.0, "eval/full/greedy_accuracy": 0.27, "eval/full/accuracy_strict": 0.26,
         "eval/full/accuracy_lenient": 0.31}
    assert eval_part(e) == ("eval@0 greedy 0.250 strict 0.200 lenient 0.300 avg@8 0.125 pass@8 0.750 "
                            "all(1319) strict 0.260 lenient 0.310")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward_mean": 0.1, "perf/step_time_s": 1.0}) + "\n")
    (run / "eval.jsonl").write_text(json.dumps(e) + "\n")
    table = format_table(summarize_run(run))
    assert "greedy 0.250, strict 0.200, lenient 0.300, avg@8" in table
    assert "all 1319 rows: greedy 0.270, strict 0.260, lenient 0.310" in table
    assert "all rows, strict" in render_html(run)
