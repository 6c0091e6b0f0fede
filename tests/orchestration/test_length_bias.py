"""The short-rollout bias: a long-tailed workload through the real buffer, schedule by schedule.

Arrival order (the old fully_async) trains the groups that finish first and drops the
long ones as stale; the deadline schedule trains every group it admits by its deadline;
the budget schedule never drops for staleness (its long groups train staler instead).
The same assertion - trained/generated response length >= 0.9 over the metric's window,
read from the buffer's own `len_ratio` - must fail for the biased schedules and hold for
the deadline one, so the check is known to catch the bias. Timing is simulated in ticks
(tests/orchestration/buffer_sim.py), so the outcome is deterministic.
"""

from __future__ import annotations

import pytest

from miles.rollout.buffer import P

from .buffer_sim import simulate


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("schedule", "admission", "unbiased"), [
    ("arrival", False, False),  # discard-and-retry alone
    ("arrival", True, False),  # admission control by group count: still biased
    ("deadline", False, True),
    ("budget", False, True),  # unbiased too, but its staleness is not bounded (below)
])
def test_len_ratio_catches_the_short_rollout_bias(schedule: str, admission: bool, unbiased: bool) -> None:
    run = simulate(schedule, admission_control=admission)  # type: ignore[arg-type]
    last = run.metrics[-1]
    assert (last[P + "len_ratio"] >= 0.9) == unbiased, (schedule, admission, last[P + "len_ratio"])
    assert (run.len_ratio >= 0.9) == unbiased, run  # over the whole run too
    assert (run.max_staleness <= 1) == (schedule != "budget")
    if unbiased:
        assert run.stale_groups == 0 and last[P + "untrained_share"] == 0.0
    else:
        assert run.stale_groups > 0 and last[P + "untrained_share/stale"] > 0.3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("train_ticks", [20, 60])
def test_deadline_keeps_throughput(train_ticks: int) -> None:
    """Trained tokens per simulated tick, trainer-bound and balanced: no worse than arrival order
    with admission control (generation-bound, arrival order trains more tokens per tick by
    dropping the long groups it is slow to generate: docs/orchestration.md)."""
    def rate(schedule: str, admission: bool) -> float:
        r = simulate(schedule, admission_control=admission, max_staleness=2, train_ticks=train_ticks)  # type: ignore[arg-type]
        return r.trained_len * r.steps / r.ticks

    assert rate("deadline", False) >= 0.95 * rate("arrival", True)


@pytest.mark.timeout(30)
def test_deadline_learns_a_trainer_that_publishes_two_versions_a_step() -> None:
    """Versions advancing by 2 per step: the schedule counts steps, not versions, once it has
    seen the stride (only the groups admitted before the first stride was seen can go stale)."""
    run = simulate("deadline", max_staleness=2, version_stride=2)
    assert run.len_ratio >= 0.9 and run.metrics[-1][P + "len_ratio"] >= 0.9
    assert sum(r[P + "stale_groups_filtered"] for r in run.metrics[3:]) == 0
    assert run.stale_groups <= 4  # one batch at most, at the first stride change
