"""A flaky reward for the chaos soak: the arithmetic env's reward, with 10% of calls slow or failing.

Used as `rollout.reward_fn = "miles.tests.e2e.chaos_reward:reward"` (with `rollout.reward_errors =
"drop"`); the fault rate is `MILES_CHAOS_REWARD_FAULTS` (default 0.1), half slow, half raising.
Each injected fault is logged (`chaos_reward_fault`), so the soak can count them from the run's logs.
"""

from __future__ import annotations

import asyncio
import os
import random

from miles.core.logging import get_logger
from miles.rollout.envs.arithmetic import reward as arithmetic_reward
from miles.rollout.layers import Prompt
from miles.rollout.types import Sample

_rng = random.Random(os.getpid())
RATE = float(os.environ.get("MILES_CHAOS_REWARD_FAULTS", "0.1"))
log = get_logger("miles.tests.chaos_reward")


async def reward(prompt: Prompt, sample: Sample) -> float:
    x = _rng.random()
    if x < RATE / 2:
        log.info("chaos_reward_fault", fault="raise", prompt_id=prompt.get("id"))
        raise RuntimeError(f"chaos: injected reward failure for {prompt.get('id')}")
    if x < RATE:
        log.info("chaos_reward_fault", fault="slow", prompt_id=prompt.get("id"))
        await asyncio.sleep(0.5)  # a slow reward (a sandbox, a remote judge)
    return arithmetic_reward(prompt, sample)
