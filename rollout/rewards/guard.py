"""The reward function behind a guard: its failures are counted, logged and never silent.

A user's reward function that raises (or returns something that is not a finite
number) is counted by exception type and logged with the prompt id. The sample
then fails with `RewardError`, so its group is dropped with that reason in the
ledger (which may retry the prompt). With `on_error = "stop"` (the default), after
`max_in_a_row` failures with no success in between the guard latches: every later
call fails at once and `check()` raises the cause, which the rollout turns into
the end of the run. With `on_error = "drop"` the run goes on.

A reward function with a `judge` parameter gets the judge pool's client (rollout/rewards/judge.py).
A judge that is down (`JudgeUnavailable`) fails its rewards, counted by reason like any
failure, but does not count toward the stop: it is the pool's outage, which the supervisor
repairs, not a bug of the function, and it must not end the run.
"""

from __future__ import annotations

import inspect
import math
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

from miles.core.errors import RewardError
from miles.core.logging import get_logger
from miles.rollout.rewards.judge import JudgeUnavailable
from miles.rollout.types import Sample

log = get_logger("miles.reward")
OnError = Literal["stop", "drop"]


class RewardGuard:
    """Callable like the reward function it wraps: `await guard(prompt, sample) -> float`."""

    def __init__(self, fn: Callable[[dict[str, Any], Sample], Any], on_error: OnError = "stop",
                 max_in_a_row: int = 3, judge: Any = None) -> None:
        if on_error not in ("stop", "drop"):
            raise ValueError(f"rollout.reward_errors {on_error!r}: valid are 'stop', 'drop'")
        if max_in_a_row < 1:
            raise ValueError(f"rollout.reward_max_errors_in_a_row must be >= 1, got {max_in_a_row}")
        self.fn = fn
        self.on_error = on_error
        self.max_in_a_row = max_in_a_row
        self.errors: Counter[str] = Counter()  # exception type name -> count, over the whole run
        self.in_a_row = 0
        self.stopped: RewardError | None = None
        self.extra: dict[str, Any] = {}  # keyword arguments the function asks for by name
        if judge is not None and _takes(fn, "judge"):
            self.extra["judge"] = judge

    async def __call__(self, prompt: dict[str, Any], sample: Sample) -> float:
        if self.stopped is not None:
            raise self.stopped
        try:
            r = self.fn(prompt, sample, **self.extra)
            if inspect.isawaitable(r):
                r = await r
            value = float(r)  # numpy / torch scalars and bools convert, as they always did
            if not math.isfinite(value):
                raise ValueError(f"the reward function returned {r!r}; expected a finite number")
        except Exception as exc:  # noqa: BLE001 - a user's function: every failure is counted and reported
            raise self._failed(prompt, exc) from exc
        self.in_a_row = 0
        return value

    def _failed(self, prompt: dict[str, Any], exc: Exception) -> RewardError:
        kind = type(exc).__name__
        self.errors[kind] += 1
        if isinstance(exc, JudgeUnavailable):  # the pool's outage, not the function's bug: no stop
            log.warning("reward_failed", prompt_id=prompt.get("id", "?"), error_type=kind, error=str(exc),
                        counts=dict(self.errors))
            return RewardError(f"reward function raised {kind}: {exc} (prompt {prompt.get('id', '?')!r}); "
                               "sample dropped")
        self.in_a_row += 1
        pid = prompt.get("id", "?")
        log.error("reward_failed", prompt_id=pid, error_type=kind, error=str(exc), in_a_row=self.in_a_row,
                  counts=dict(self.errors), policy=self.on_error)
        if self.on_error == "stop" and self.in_a_row >= self.max_in_a_row:
            self.stopped = RewardError(
                f"the reward function failed {self.in_a_row} times in a row (last: prompt {pid!r}, {kind}: "
                f"{exc}; failures by type: {dict(self.errors)}); fix it, or set rollout.reward_errors = "
                "'drop' to drop such samples and go on")
            return self.stopped
        return RewardError(f"reward function raised {kind}: {exc} (prompt {pid!r}); sample dropped")

    def check(self) -> None:
        """Raise the cause once the guard has stopped (the rollout fails the trainer's pull with it)."""
        if self.stopped is not None:
            raise self.stopped


def _takes(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
