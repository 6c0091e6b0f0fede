"""Config section for evaluation during training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from miles.core.config import opt
from miles.core.errors import ConfigError


@dataclass
class EvalConfig:
    mode: Literal["none", "shared", "snapshot", "external"] = opt(
        "none",
        "shared: pause new generation on the rollout engines, let in-flight requests finish, evaluate, "
        "resume; snapshot: a dedicated eval engine gets a weight snapshot and evaluates alongside "
        "training; external: export an HF checkpoint and run `command` on it",
    )
    every_steps: int = opt(20, "evaluate after every this many training steps", "steps")
    num_prompts: int = opt(64, "prompts per evaluation (greedy, one sample each): the first of the eval set, "
                           "the same every time", "prompts")
    full_at_ends: bool = opt(
        False, "the step-0 (at_start) and final (at_end) evaluations also greedy-decode every row of a "
        "finite eval set (eval/full/*: all of GSM8K's test split, say), besides the num_prompts subset; "
        "the final one runs even when the last step was an every_steps one")
    env_args: dict[str, Any] = opt(
        {"seed": 1_000_003}, "make_env keyword arguments for the eval set (a seed disjoint from training)"
    )
    max_new_tokens: int = opt(32, "most tokens sampled per eval answer", "tokens")
    at_start: bool = opt(False, "also evaluate the initial weights before the first training step (step 0)")
    at_end: bool = opt(False, "also evaluate the final weights when the last step is not an every_steps one")
    samples: int = opt(
        0, "k: sampled answers per prompt besides the greedy one, for eval/avg_at_k (mean reward of the "
        "k) and eval/pass_at_k (share of prompts with at least one correct answer); 0 = greedy only", "samples")
    temperature: float = opt(1.0, "sampling temperature of the k sampled eval answers")
    correct_reward: float = opt(1.0, "an answer counts as correct (greedy_accuracy, pass@k) at a reward >= this")
    command: str = opt(
        "", "external mode: shell command run on each exported checkpoint; '{checkpoint}' and '{step}' "
        "are substituted; a JSON object on its last stdout line becomes eval/external/* metrics"
    )
    timeout_s: float = opt(600.0, "an evaluation still running after this is abandoned and counted skipped", "s")

    def __post_init__(self) -> None:
        if self.mode == "external" and not self.command:
            raise ConfigError("eval.mode = 'external' needs eval.command, e.g. "
                              "'python my_eval.py --model {checkpoint}'")
        if self.mode != "none" and self.every_steps < 1:
            raise ConfigError(f"eval.every_steps must be >= 1, got {self.every_steps}")
        if self.samples < 0:
            raise ConfigError(f"eval.samples must be >= 0 (0 = greedy only), got {self.samples}")
