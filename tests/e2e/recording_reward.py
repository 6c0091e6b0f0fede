"""Rewards that score as the recipes' envs do and record every sample they see, for the
real-checkpoint smoke tests (tests/e2e/test_e2e_real_checkpoint.py).

    rollout.reward_fn = "miles.tests.e2e.recording_reward:gsm8k"      (or :tool_math)

Each call appends one JSON line to $MILES_RECORD_SAMPLES: the prompt (id, messages, label),
the token ids the trainer will get, the loss mask, the decoded response, the agent's
metadata and the reward.
"""

from __future__ import annotations

import json
import os
from typing import Any

from miles.rollout.envs.tool_math import audited_reward
from miles.rollout.layers import Prompt
from miles.rollout.rewards.rules import MathReward
from miles.rollout.types import Sample

_math = MathReward()


def _record(prompt: Prompt, sample: Sample, reward: float) -> float:
    rec: dict[str, Any] = {
        "id": prompt.get("id"), "messages": prompt.get("messages"), "label": prompt.get("label"),
        "answer": prompt.get("answer"), "prompt_ids": sample.prompt_ids, "response_ids": sample.response_ids,
        "loss_mask": sample.loss_mask, "n_logprobs": len(sample.rollout_logprobs),
        "metadata": {k: v for k, v in sample.metadata.items() if isinstance(v, str | int | float)},
        "reward": reward,
    }
    with open(os.environ["MILES_RECORD_SAMPLES"], "a") as f:
        f.write(json.dumps(rec) + "\n")
    return reward


def gsm8k(prompt: Prompt, sample: Sample) -> float:
    return _record(prompt, sample, _math(prompt, sample))


def tool_math(prompt: Prompt, sample: Sample) -> float:
    return _record(prompt, sample, audited_reward(prompt, sample))
