"""The progress line's state across steps (what the console and trainer rank 0 both print)."""

from __future__ import annotations

import pytest

from miles.metrics.progress import Progress, fmt_eta

pytestmark = pytest.mark.timeout(30)


def _row(step: int, reward: float) -> dict[str, float]:
    return {"step": step, "rollout/reward_mean": reward, "perf/step_time_s": 2.0, "perf/train_s": 1.5,
            "train/tokens_per_s": 1234.4}


def test_first_step_uses_its_own_time_then_the_rate_since_it() -> None:
    p = Progress(10)
    first = p.line(_row(2, 0.5), now=100.0)
    # one step in its 2.0 s: 8 steps left -> 16 s
    assert first.startswith("step  2/10  20%") and "ETA 0:16" in first
    assert "tok/s 1234" in first and "step 2.00s (train 1.50s)" in first
    later = p.line(_row(6, 1.0), now=104.0)  # 4 steps in 4 s since the first: 4 left -> 4 s
    assert "ETA 0:04" in later
    assert "reward 1.000 (avg10 0.750)" in later


def test_rows_without_reward_or_time() -> None:
    line = Progress(3).line({"step": 1}, now=0.0)
    assert line == "step 1/3  33% | ETA -"


def test_eta_format() -> None:
    assert fmt_eta(59.6) == "1:00" and fmt_eta(3600) == "1:00:00" and fmt_eta(-5) == "0:00"
