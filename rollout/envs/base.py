"""What an environment module provides: `make_env(**rollout.env_args) -> Environment`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from miles.rollout.layers import Prompt, RewardFn


class PromptSource(Protocol):
    """An endless, deterministic prompt stream whose position can be checkpointed."""

    def next(self) -> Prompt: ...
    def item(self, i: int) -> Prompt: ...
    def state(self) -> dict[str, Any]: ...
    def load_state(self, state: dict[str, Any]) -> None: ...


@dataclass
class Environment:
    name: str
    prompts: PromptSource
    reward: RewardFn
    agent: str  # import path of the agent layer this env is meant to run with
    tools: list[dict[str, Any]] | None = None
