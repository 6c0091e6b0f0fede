"""Built-in rewards: exact answer, last number in the text, and a format reward.

Each is a plain function `(prompt, sample) -> float` reading the sample's
`metadata["response"]` (the agent's final text) and the prompt's `answer`.
"""

from __future__ import annotations

import math
import re
from typing import Any

from miles.rollout.types import Sample

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _text(sample: Sample) -> str:
    t = sample.metadata.get("response", "")
    return t if isinstance(t, str) else str(t)


def normalize_answer(s: str) -> str:
    return " ".join(s.strip().split()).rstrip(".").lower()


def exact_answer(prompt: dict[str, Any], sample: Sample) -> float:
    """1.0 when the response equals the expected answer (whitespace/case/trailing '.' ignored)."""
    return float(normalize_answer(_text(sample)) == normalize_answer(str(prompt["answer"])))


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def last_number_reward(prompt: dict[str, Any], sample: Sample, tol: float = 1e-6) -> float:
    """1.0 when the last number in the response equals the numeric answer."""
    got = last_number(_text(sample))
    want = float(prompt["answer"])
    return float(got is not None and math.isclose(got, want, rel_tol=0.0, abs_tol=tol))


def format_reward(text: str, pattern: str = r"^-?\d+$") -> float:
    """1.0 when the whole (stripped) text matches `pattern` (default: a bare integer)."""
    return float(re.fullmatch(pattern, text.strip()) is not None)


def exact_with_format(prompt: dict[str, Any], sample: Sample, format_weight: float = 0.1) -> float:
    """Exact answer plus a small bonus for answering in the expected format."""
    return exact_answer(prompt, sample) + format_weight * format_reward(_text(sample))
