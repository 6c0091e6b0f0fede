"""What an environment module provides: `make_env(**rollout.env_args) -> Environment`."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from miles.rollout.layers import Prompt, RewardFn


class PromptSource(Protocol):
    """An endless, deterministic prompt stream whose position can be checkpointed."""

    def next(self) -> Prompt: ...
    def item(self, i: int) -> Prompt: ...
    def state(self) -> dict[str, Any]: ...
    def load_state(self, state: dict[str, Any]) -> None: ...


# An evaluation-only score of one decoded answer to a prompt (1.0 right, 0.0 wrong): the evaluator
# reports each as eval/accuracy_<name> beside the reward (see rollout/envs/gsm8k.py).
Scorer = Callable[[Prompt, str], float]


@dataclass
class Environment:
    name: str
    prompts: PromptSource
    reward: RewardFn
    agent: str  # import path of the agent layer this env is meant to run with
    tools: list[dict[str, Any]] | None = None
    scorers: dict[str, Scorer] = field(default_factory=dict)


class SeededPrompts(abc.ABC):
    """Mixin for deterministic, endless prompt sources: `item(i)` is a pure function of (seed, i).

    The data position is the only state, so `state()`/`load_state()` resume exactly.
    Subclasses are dataclasses with `seed` and `position` fields and an `item(i)` method.
    """

    seed: int
    position: int
    env_name = "env"

    @abc.abstractmethod
    def item(self, i: int) -> Prompt:
        """The i-th prompt: a pure function of (seed, i)."""

    def next(self) -> Prompt:
        p = self.item(self.position)
        self.position += 1
        return p

    def state(self) -> dict[str, Any]:
        return {"seed": self.seed, "position": self.position}

    def load_state(self, state: dict[str, Any]) -> None:
        from miles.core.errors import ConfigError

        if state.get("seed") != self.seed:
            raise ConfigError(f"{self.env_name} env: checkpoint seed {state.get('seed')!r} "
                              f"!= configured {self.seed}")
        self.position = int(state["position"])

