"""Long-tailed response lengths over any environment: a per-prompt `max_new_tokens` budget.

Wraps another env's prompts and gives prompt i a budget drawn from a log-normal
distribution seeded by (seed, i) only, so the workload is identical across runs and
orchestration modes (what bench/async_vs_sync.py compares). The rollout actor honours
a prompt's `max_new_tokens` over `rollout.max_new_tokens`, and its `sampling` dict
over the configured sampling (`ignore_stop` uses that to sample every budget in full).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Any

from miles.core.errors import ConfigError
from miles.core.hooks import resolve_hook
from miles.rollout.envs.base import Environment, PromptSource
from miles.rollout.layers import Prompt


@dataclass
class LongTailPrompts:
    """The base stream's prompts, each with a log-normal `max_new_tokens` in [min_tokens, max_tokens]."""

    base: PromptSource
    median_tokens: float
    sigma: float
    min_tokens: int
    max_tokens: int
    seed: int = 0
    ignore_stop: bool = False  # sample the whole budget: lengths follow the distribution exactly

    def __post_init__(self) -> None:
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(f"long_tail env: need 1 <= min_tokens ({self.min_tokens}) <= max_tokens "
                              f"({self.max_tokens})")
        if self.median_tokens <= 0 or self.sigma < 0:
            raise ConfigError(f"long_tail env: median_tokens ({self.median_tokens}) must be > 0 and sigma "
                              f"({self.sigma}) >= 0")

    def budget(self, index: int) -> int:
        x = random.Random(self.seed * 7_919 + index).lognormvariate(math.log(self.median_tokens), self.sigma)
        return max(self.min_tokens, min(self.max_tokens, round(x)))

    def _with_budget(self, p: Prompt) -> Prompt:
        out = {**p, "max_new_tokens": self.budget(int(p.get("index", 0)))}
        if self.ignore_stop:
            out["sampling"] = {**p.get("sampling", {}), "stop_token_ids": []}
        return out

    def item(self, i: int) -> Prompt:
        return self._with_budget(self.base.item(i))

    def next(self) -> Prompt:
        return self._with_budget(self.base.next())

    def state(self) -> dict[str, Any]:
        return self.base.state()

    def load_state(self, state: dict[str, Any]) -> None:
        self.base.load_state(state)


def make_env(base: str = "miles.rollout.envs.arithmetic:make_env", base_args: dict[str, Any] | None = None,
             median_tokens: float = 8.0, sigma: float = 1.0, min_tokens: int = 1, max_tokens: int = 64,
             seed: int = 0, ignore_stop: bool = False) -> Environment:
    env: Environment = resolve_hook(base, "rollout.env_args.base")(**(base_args or {}))
    prompts = LongTailPrompts(env.prompts, median_tokens, sigma, min_tokens, max_tokens, seed, ignore_stop)
    return replace(env, name=f"{env.name}+long_tail", prompts=prompts)
