"""GSM8K through the dataset env, optionally cut to the problems with few calculator steps.

    [rollout]
    env = "miles.rollout.envs.gsm8k:make_env"
    env_args = {path = "../shared/data/gsm8k/train.jsonl", eval_path = "../shared/data/gsm8k/test.jsonl",
                max_calc_steps = 2}

Every dataset-env option applies (prompt_key defaults to "question", label_key to "answer").
The label is GSM8K's worked answer; the math reward scores the number after its `####`.
`max_calc_steps = n` keeps only the rows whose reference answer has at most n calculator
annotations (`<<48/2=24>>`), an honest proxy for how many arithmetic steps a problem takes:
a small model can start learning on those (GSM8K test: 440 of 1,319 rows have at most two).
The cut is applied to both splits, so the held-out set is the same kind of problem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.core.errors import ConfigError
from miles.rollout.envs.base import Environment
from miles.rollout.envs.dataset import DatasetPrompts, make_dataset, parse_config

DEFAULTS = {"prompt_key": "question", "label_key": "answer", "rewards": [{"type": "math"}]}


def calc_steps(label: Any) -> int:
    """Calculator annotations (`<<...>>`) in a GSM8K reference answer."""
    return str(label).count("<<")


def cut(prompts: DatasetPrompts, max_calc_steps: int) -> DatasetPrompts:
    """The rows with at most `max_calc_steps` annotations, file order kept; 0 = all rows."""
    if max_calc_steps <= 0:
        return prompts
    kept = [r for r in prompts.rows if calc_steps(r.label) <= max_calc_steps]
    if not kept:
        raise ConfigError(f"gsm8k env: no row has at most {max_calc_steps} calculator steps")
    return DatasetPrompts(kept, prompts.seed, prompts.shuffle, f"{prompts.fingerprint}:cut{max_calc_steps}")


def make_env(max_calc_steps: int = 0, **env_args: Any) -> Environment:
    if not isinstance(max_calc_steps, int) or isinstance(max_calc_steps, bool) or max_calc_steps < 0:
        raise ConfigError(f"rollout.env_args.max_calc_steps must be an integer >= 0, got {max_calc_steps!r}")
    cfg = parse_config({**DEFAULTS, **env_args})
    prompts, reward = make_dataset(cfg)
    prompts = cut(prompts, max_calc_steps)
    name = f"gsm8k:{Path(cfg.path).stem}" + (f":le{max_calc_steps}" if max_calc_steps else "")
    return Environment(name, prompts, reward, cfg.agent)
