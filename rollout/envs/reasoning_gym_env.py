"""reasoning-gym tasks, unchanged: its procedural datasets for prompts, its scorers for rewards.

    [rollout]
    env = "miles.rollout.envs.reasoning_gym_env:make_env"
    env_args = {task = "basic_arithmetic", config = {min_terms = 2, max_terms = 2}, seed = 0}

`task` is any name `reasoning_gym.create_dataset` knows (its registry); `config` is that
dataset's own config (its keyword arguments: sizes, difficulty). `size` entries are made from
`seed`; prompt i is entry i mod size, so a run sees the set in epochs and resumes by position.
The reward is the dataset's `score_answer(answer, entry)` on the model's answer: the text inside
`<answer_tag>` ... `</answer_tag>` (its `extract_answer`), or the whole reply with answer_tag = "".
Every trajectory passes the token-drift audit before it is scored (rollout/envs/hub_common.py).
Needs `pip install 'miles[reasoning-gym]'`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from miles.core.errors import ConfigError
from miles.rollout.envs.base import Environment, SeededPrompts
from miles.rollout.envs.hub_common import TurnCount, audited, chat_turn, require
from miles.rollout.layers import AgentContext, Prompt
from miles.rollout.types import Sample

EXTRA = "reasoning-gym"
# the short instruction a small model follows; rg's own SYSTEM_PROMPTS (e.g. "default")
# ask for step-by-step reasoning and <answer> tags, which suit larger models
DIRECT = "Reply with the answer only."


def _rg() -> Any:
    return require("reasoning_gym", EXTRA, "the reasoning-gym env")


@dataclass
class ReasoningGymPrompts(SeededPrompts):
    """Entries of one reasoning-gym dataset in a fixed order; `state()` is the position."""

    env_name = "reasoning_gym"

    task: str = "basic_arithmetic"
    config: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    size: int = 1000
    system_prompt: str = DIRECT
    position: int = 0

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"reasoning_gym env: size must be >= 1, got {self.size}")
        self.dataset  # noqa: B018 - build it now: a bad task name or config fails at start-up

    @cached_property
    def dataset(self) -> Any:
        rg = _rg()
        try:
            return rg.create_dataset(self.task, **{**self.config, "seed": self.seed, "size": self.size})
        except (ValueError, TypeError, AssertionError) as exc:
            raise ConfigError(f"reasoning_gym env: task {self.task!r} with config {self.config}: {exc}") from exc

    def entry(self, i: int) -> dict[str, Any]:
        return dict(self.dataset[i % self.size])

    def item(self, i: int) -> Prompt:
        e = self.entry(i)
        msgs = [{"role": "user", "content": str(e["question"])}]
        if self.system_prompt:
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return {"id": f"rg-{self.task}-{self.seed}-{i % self.size}", "index": i, "rg_index": i % self.size,
                "answer": str(e["answer"]), "messages": msgs}


async def reasoning_gym_agent(ctx: AgentContext) -> dict[str, Any]:
    """One turn; the reply is the answer (reporting what it sampled for the drift audit)."""
    count = TurnCount()
    reply = await chat_turn(ctx, ctx.prompt["messages"], count)
    return {"response": reply["message"].get("content") or "", "finish_reason": reply["finish_reason"],
            "turns": count.turns, "sampled_tokens": count.sampled}


def rg_answer(text: str, answer_tag: str) -> str | None:
    if not answer_tag:
        return text.strip()
    return _rg().utils.extract_answer(text, tag_name=answer_tag)


def make_reward(prompts: ReasoningGymPrompts, answer_tag: str) -> Any:
    def rg_score(prompt: Prompt, sample: Sample) -> float:
        entry = prompts.entry(int(prompt["rg_index"]))
        return float(prompts.dataset.score_answer(rg_answer(str(sample.metadata.get("response", "")), answer_tag),
                                                  entry))

    return audited(rg_score)


def make_env(task: str = "basic_arithmetic", config: dict[str, Any] | None = None, seed: int = 0,
             size: int = 1000, system_prompt: str = DIRECT, answer_tag: str = "") -> Environment:
    prompts = ReasoningGymPrompts(task, dict(config or {}), seed, size, system_prompt)
    return Environment(f"reasoning_gym:{task}", prompts, make_reward(prompts, answer_tag),
                       "miles.rollout.envs.reasoning_gym_env:reasoning_gym_agent")
