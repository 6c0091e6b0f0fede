"""Deadline admission (rollout/schedule.py): no group starts while the current version's batch
is complete; the next version's groups then carry its later deadline."""

from __future__ import annotations

import pytest

from miles.rollout.buffer import RolloutBuffer
from miles.rollout.schedule import admits

from .test_rollout_buffer import prompt, traj

pytestmark = pytest.mark.timeout(60)


def test_admits_holds_once_the_batch_of_this_version_is_taken() -> None:
    # batch 4, max_staleness 2: room for 12 outstanding + taken this version
    assert admits(3, 3, 2, 4)
    assert not admits(3, 4, 2, 4)  # the batch is complete: wait for the next version
    assert not admits(8, 4, 2, 4)  # (as before: the bound itself)
    assert admits(7, 0, 2, 4) and not admits(12, 0, 2, 4)


@pytest.mark.parametrize("schedule", ["deadline", "budget"])
def test_no_group_starts_between_a_full_batch_and_the_next_version(schedule: str) -> None:
    buf = RolloutBuffer(capacity=4, n_samples=2, max_staleness=2, batch_groups=2, schedule=schedule,
                        prompt_source=iter([prompt(f"p{i}") for i in range(100)]).__next__)
    work = buf.fill()  # p0, p1: the 4 slots bound it, not (max_staleness + 1) * batch = 6 groups
    for w in work:  # each freed slot starts the next group at once: p2, p3
        work += buf.finish(w, traj(0))
        if len(work) == 8:
            break
    assert sorted({w.prompt_id for w in work}) == ["p0", "p1", "p2", "p3"]
    assert len(buf.collect(2, 0)) == 2  # p0, p1: version 0's batch is complete
    # 2 outstanding + 2 taken is below the bound, and a slot frees: still nothing starts while
    # the trainer trains version 0's batch
    assert buf.finish(work[4], traj(0)) == [] and buf.fill() == []
    buf.set_version(1)
    new = buf.fill()
    assert {w.prompt_id for w in new} == {"p4"}  # the room opens with version 1
    todo = work[5:] + new
    while todo:  # finish p2, p3, p4 (a group started meanwhile keeps generating)
        todo += [w for w in buf.finish(todo.pop(0), traj(1)) if w.prompt_id == "p4"]
    got = buf.collect(3, 1)
    if schedule == "deadline":  # p2, p3 admitted at version 0, p4 at version 1
        assert {g.prompt_id: g.metadata["deadline"] for g in got} == {"p2": 2, "p3": 2, "p4": 3}
