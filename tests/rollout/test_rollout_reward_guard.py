"""Reward-function failures are counted by type, name the prompt, drop the sample, and stop the run when asked."""

from __future__ import annotations

import asyncio
import math

import pytest

from miles.core.errors import RewardError
from miles.rollout.rewards.guard import RewardGuard
from miles.rollout.types import Sample


def _flaky(prompt: dict, sample: Sample) -> float:
    if prompt["id"].startswith("bad"):
        raise KeyError("answer")
    if prompt["id"].startswith("nan"):
        return math.nan
    return 1.0


async def _async_ok(prompt: dict, sample: Sample) -> float:
    await asyncio.sleep(0)
    return 0.5


async def test_drop_policy_counts_by_type_and_goes_on() -> None:
    g = RewardGuard(_flaky, "drop", max_in_a_row=2)
    s = Sample(prompt_ids=[1])
    for pid in ("bad-1", "bad-2", "nan-3", "bad-4"):
        with pytest.raises(RewardError, match=f"prompt '{pid}'"):
            await g({"id": pid}, s)
    assert g.errors == {"KeyError": 3, "ValueError": 1}
    assert await g({"id": "ok"}, s) == 1.0
    g.check()  # drop never stops the run
    assert await RewardGuard(_async_ok)({"id": "a"}, s) == 0.5


async def test_stop_policy_latches_after_n_in_a_row() -> None:
    g = RewardGuard(_flaky, "stop", max_in_a_row=3)
    s = Sample(prompt_ids=[1])
    for pid in ("bad-1", "bad-2"):
        with pytest.raises(RewardError, match="sample dropped"):
            await g({"id": pid}, s)
    assert await g({"id": "ok"}, s) == 1.0  # a success resets the count
    for pid in ("bad-3", "bad-4"):
        with pytest.raises(RewardError, match="sample dropped"):
            await g({"id": pid}, s)
    g.check()
    with pytest.raises(RewardError, match="failed 3 times in a row .*prompt 'bad-5'.*KeyError"):
        await g({"id": "bad-5"}, s)
    with pytest.raises(RewardError, match="3 times in a row"):
        g.check()
    with pytest.raises(RewardError, match="3 times in a row"):
        await g({"id": "ok"}, s)  # latched: later samples fail at once with the cause
