"""Single-turn arithmetic: "3+4=" → "7", rewarded by exact answer (the quick start).

Prompts come from a deterministic generator: prompt i is a function of (seed, i)
only, so the data position is just an integer that checkpoints save and restore.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from miles.core.errors import ConfigError
from miles.rollout.envs.base import Environment, SeededPrompts
from miles.rollout.layers import Prompt
from miles.rollout.rewards.builtin import exact_answer
from miles.rollout.types import Sample


@dataclass
class ArithmeticPrompts(SeededPrompts):
    """Deterministic, endless 'a+b=' prompts; `state()`/`load_state()` give the data position."""

    env_name = "arithmetic"

    seed: int = 0
    max_operand: int = 9
    ops: str = "+"
    position: int = 0

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ConfigError(f"arithmetic env: max_operand must be >= 1, got {self.max_operand}")
        bad = set(self.ops) - set("+-*")
        if not self.ops or bad:
            raise ConfigError(f"arithmetic env: ops must be made of '+', '-', '*', got {self.ops!r}")

    def item(self, i: int) -> Prompt:
        rng = random.Random(self.seed * 1_000_003 + i)
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice(self.ops)
        ans = a + b if op == "+" else a - b if op == "-" else a * b
        q = f"{a}{op}{b}="
        return {"id": f"arith-{self.seed}-{i}", "index": i, "question": q, "answer": str(ans),
                "messages": [{"role": "user", "content": q}]}



def reward(prompt: Prompt, sample: Sample) -> float:
    return exact_answer(prompt, sample)


def make_env(seed: int = 0, max_operand: int = 9, ops: str = "+") -> Environment:
    return Environment("arithmetic", ArithmeticPrompts(seed, max_operand, ops), reward,
                       "miles.rollout.layers:single_turn_agent")
