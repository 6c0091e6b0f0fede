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

Two evaluation scorers (reported by the evaluator as `eval/accuracy_strict` and
`eval/accuracy_lenient`) tell format learning from reasoning: strict takes the first number
in the answer's marked place, the format the prompt asks for (`answer_format = "hash"`: after
the response's last `####`; `"boxed"`: inside its last `\boxed{}`; no marker: wrong); lenient
takes the response's last number wherever it is. Both compare it with the number after the
label's `####`. A run whose strict accuracy rises while lenient stays flat learned the format;
one whose lenient accuracy rises solves more problems.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles.core.errors import ConfigError
from miles.rollout.envs.base import Environment
from miles.rollout.envs.dataset import DatasetPrompts, make_dataset, parse_config
from miles.rollout.rewards.rules import extract_boxed

DEFAULTS = {"prompt_key": "question", "label_key": "answer", "rewards": [{"type": "math"}]}
# A number as GSM8K writes one: "1,250", "-3", "0.5", "$18"; a minus right after a digit is the
# operator of "16-3", not a sign.
NUMBER = re.compile(r"(?<![\d.,])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def _value(token: str) -> float:
    return float(token.replace(",", ""))


def strict_answer(text: str) -> float | None:
    """The first number after the last `####`; None without `####` or a number after it."""
    k = text.rfind("####")
    m = NUMBER.search(text, k + 4) if k >= 0 else None
    return _value(m.group()) if m else None


def boxed_answer(text: str) -> float | None:
    """The first number inside the last `\\boxed{}`; None without one (or cut off before its `}`)."""
    inside = extract_boxed(text)
    m = NUMBER.search(inside) if inside is not None else None
    return _value(m.group()) if m else None


def lenient_answer(text: str) -> float | None:
    """The last number anywhere in the text; None when it has none."""
    found = NUMBER.findall(text)
    return _value(found[-1]) if found else None


def _same(pred: float | None, label: Any) -> float:
    gold = strict_answer(str(label))
    if pred is None or gold is None:
        return 0.0
    return float(abs(pred - gold) <= 1e-6 * max(1.0, abs(gold)))


def score_strict(prompt: dict[str, Any], response: str) -> float:
    return _same(strict_answer(response), prompt["label"])


def score_boxed(prompt: dict[str, Any], response: str) -> float:
    return _same(boxed_answer(response), prompt["label"])


def score_lenient(prompt: dict[str, Any], response: str) -> float:
    return _same(lenient_answer(response), prompt["label"])


# The strict scorer per answer format: the place the prompt asks the final answer to go.
STRICT: dict[str, Callable[[dict[str, Any], str], float]] = {"hash": score_strict, "boxed": score_boxed}


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


def make_env(max_calc_steps: int = 0, answer_format: str = "hash", **env_args: Any) -> Environment:
    if not isinstance(max_calc_steps, int) or isinstance(max_calc_steps, bool) or max_calc_steps < 0:
        raise ConfigError(f"rollout.env_args.max_calc_steps must be an integer >= 0, got {max_calc_steps!r}")
    if answer_format not in STRICT:
        raise ConfigError(f"rollout.env_args.answer_format must be one of {sorted(STRICT)} (where the prompt asks "
                          f"for the final answer: after #### or inside \\boxed{{}}), got {answer_format!r}")
    cfg = parse_config({**DEFAULTS, **env_args})
    prompts, reward = make_dataset(cfg)
    prompts = cut(prompts, max_calc_steps)
    name = f"gsm8k:{Path(cfg.path).stem}" + (f":le{max_calc_steps}" if max_calc_steps else "")
    return Environment(name, prompts, reward, cfg.agent,
                       scorers={"strict": STRICT[answer_format], "lenient": score_lenient})
