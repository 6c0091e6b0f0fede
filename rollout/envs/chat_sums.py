"""Small sums for a real chat model: "What is 7 plus 5? Answer with just the number."

    [rollout]
    env = "miles.rollout.envs.chat_sums:make_env"
    env_args = {max_operand = 20}

The CPU learning gate's task (bench/learn_gate_cpu.py, examples/learn_gate_cpu.toml). It is
within a 135M instruct model's reach: greedy, SmolLM2-135M-Instruct answers "7 + 5 = 12" and
gets about half of the sums right, but its temperature-1 samples mostly wander off ("To solve
this problem, we need...", cut by the token cap). Reward: the last number of the answer equals
the sum. Sampled answers thus start low and RL sharpens them toward the model's own best
answer within a few steps, which a held-out avg@k shows. Prompt i is a pure function of
(seed, i), as in the arithmetic env, so the eval set (another seed) is held out from training.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from miles.core.errors import ConfigError
from miles.rollout.envs.base import Environment, SeededPrompts
from miles.rollout.layers import Prompt
from miles.rollout.rewards.builtin import last_number_reward
from miles.rollout.types import Sample

QUESTION = "What is {a} plus {b}? Answer with just the number."


@dataclass
class ChatSumsPrompts(SeededPrompts):
    env_name = "chat_sums"

    seed: int = 0
    max_operand: int = 20
    position: int = 0

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ConfigError(f"chat_sums env: max_operand must be >= 1, got {self.max_operand}")

    def item(self, i: int) -> Prompt:
        rng = random.Random(self.seed * 1_000_003 + i)
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        q = QUESTION.format(a=a, b=b)
        return {"id": f"chatsums-{self.seed}-{i}", "index": i, "question": q, "answer": str(a + b),
                "messages": [{"role": "user", "content": q}]}


def reward(prompt: Prompt, sample: Sample) -> float:
    return last_number_reward(prompt, sample)


def make_env(seed: int = 0, max_operand: int = 20) -> Environment:
    return Environment("chat_sums", ChatSumsPrompts(seed, max_operand), reward,
                       "miles.rollout.layers:single_turn_agent")



def inverted_reward(prompt: Prompt, sample: Sample) -> float:
    """A deliberately wrong reward (1 for every answer that is not the sum) for the learning
    gate's self-check (bench/learn_gate_cpu.py --break wrong_reward): trained on it, the
    held-out reward, which the evaluator scores with `reward`, must not rise."""
    return 1.0 - reward(prompt, sample)
