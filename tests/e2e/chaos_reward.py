"""A flaky reward for the chaos soak: the arithmetic env's reward, with 10% of calls slow or failing.

Used as `rollout.reward_fn = "miles.tests.e2e.chaos_reward:reward"` (with `rollout.reward_errors =
"drop"`); the fault rate is `MILES_CHAOS_REWARD_FAULTS` (default 0.1), half slow, half raising.
"""

from __future__ import annotations

import asyncio
import os
import random

from miles.rollout.envs.arithmetic import reward as arithmetic_reward
from miles.rollout.layers import Prompt
from miles.rollout.types import Sample

_rng = random.Random(os.getpid())
RATE = float(os.environ.get("MILES_CHAOS_REWARD_FAULTS", "0.1"))


async def reward(prompt: Prompt, sample: Sample) -> float:
    x = _rng.random()
    if x < RATE / 2:
        raise RuntimeError(f"chaos: injected reward failure for {prompt.get('id')}")
    if x < RATE:
        await asyncio.sleep(0.5)  # a slow reward (a sandbox, a remote judge)
    return arithmetic_reward(prompt, sample)
