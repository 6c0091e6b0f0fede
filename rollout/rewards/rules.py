"""Rule rewards chosen by name: math equivalence, exact/normalised match, multiple choice, format.

A dataset env lists its rewards as tables, each with a `type` tag, a `weight` and the
type's own options, e.g. `rewards = [{type = "math"}, {type = "format", weight = 0.1}]`.
Each type is a small dataclass: its fields are the options (checked like any config
section, so an unknown or mistyped option is an error naming it), `__call__(prompt,
sample)` scores the sample's final text against the prompt's `label`, and
`check_label(label)` says what is wrong with a label before a run starts (`miles data check`).
"""

from __future__ import annotations

import functools
import inspect
import re
import string
import threading
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

from miles.core.config import from_dict
from miles.core.errors import ConfigError
from miles.core.hooks import Registry
from miles.rollout.types import Sample


class RuleReward(Protocol):
    """One named reward: scores a sample; validates a dataset label ahead of a run."""

    needs_label: bool

    def __call__(self, prompt: dict[str, Any], sample: Sample) -> float | Awaitable[float]: ...
    def check_label(self, label: Any) -> str | None: ...


def response_text(sample: Sample) -> str:
    t = sample.metadata.get("response", "")
    return t if isinstance(t, str) else str(t)


# ---- answer extraction ------------------------------------------------------------------

def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None  # unbalanced: the answer was cut off


def extract_hash(text: str) -> str | None:
    """What follows the last `####` (GSM8K style) up to the end of that line; None if absent."""
    k = text.rfind("####")
    if k < 0:
        return None
    return text[k + 4:].strip().split("\n", 1)[0].strip() or None


Extract = Literal["auto", "boxed", "hash", "none"]


def extract_answer(text: str, mode: Extract = "auto") -> str | None:
    """The final answer in `text`: auto = `\\boxed{}`, else `####`, else the whole text."""
    if mode == "none":
        return text.strip()
    if mode == "boxed":
        return extract_boxed(text)
    if mode == "hash":
        return extract_hash(text)
    found = extract_boxed(text)
    if found is None:
        found = extract_hash(text)
    return text.strip() if found is None else found


_NUM = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def _as_number(s: str) -> float | None:
    t = s.strip().strip("$").replace(",", "").rstrip(".").strip()
    return float(t) if _NUM.match(t) else None


# ---- math ----------------------------------------------------------------------------------

def _mv_timeout(seconds: int) -> int | None:
    # math-verify's timeouts use SIGALRM, which only the main thread may set
    return seconds if threading.current_thread() is threading.main_thread() else None


def _parse(text: str, bare: bool, timeout: int) -> list[Any]:
    """math-verify's parse; a bare answer ("x+1", "\\frac12") is tried as inline LaTeX first."""
    from math_verify import parse

    if bare and "$" not in text:
        parsed = parse(f"${text}$", parsing_timeout=_mv_timeout(timeout))
        if parsed:
            return list(parsed)
    return list(parse(text, parsing_timeout=_mv_timeout(timeout)))


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout: int) -> tuple[Any, ...]:
    return tuple(_parse(gold, True, timeout))


@dataclass
class MathReward:
    """1.0 when the answer equals the label as mathematics (`math-verify`): 0.5 = \\frac{1}{2}.

    The answer is the response's last `\\boxed{}`, else what follows `####`, else the whole
    response (`extract = "auto"`; `"none"`: always the whole response); `extract = "hash"` takes only what follows the last `####`
    and `"boxed"` only the last `\\boxed{}` (no marker: 0), so the reward also asks for the
    format the prompt names. A GSM8K-style label ("reasoning #### 72") is reduced the same
    way. Plain numbers on both sides are compared numerically without a parse.
    """

    weight: float = 1.0
    timeout_s: int = 5  # per parse / verify call; needs the main thread (else no limit)
    extract: Extract = "auto"
    needs_label = True

    def gold(self, label: Any) -> str:
        s = str(label)
        return extract_answer(s, "auto") or s

    def __call__(self, prompt: dict[str, Any], sample: Sample) -> float:
        gold = self.gold(prompt["label"])
        text = response_text(sample)
        marked: str | None = None
        if self.extract in ("hash", "boxed"):  # the format is part of the answer
            marked = extract_hash(text) if self.extract == "hash" else extract_boxed(text)
            if marked is None:
                return 0.0
        elif self.extract == "auto":
            marked = extract_boxed(text)
            if marked is None:
                marked = extract_hash(text)
        pred = (text if marked is None else marked).strip()
        g, p = _as_number(gold), _as_number(pred)
        if g is not None and p is not None:
            return float(abs(g - p) <= 1e-6 * max(1.0, abs(g)))
        if not pred:
            return 0.0
        from math_verify import verify

        parsed_gold = list(_parse_gold(gold, self.timeout_s))
        parsed_pred = _parse(pred, marked is not None, self.timeout_s)
        if not parsed_gold or not parsed_pred:
            return 0.0
        return float(verify(parsed_gold, parsed_pred, timeout_seconds=_mv_timeout(self.timeout_s)))

    def check_label(self, label: Any) -> str | None:
        gold = self.gold(label)
        if _as_number(gold) is not None:
            return None
        # math-verify falls back to the raw string when sympy cannot read it
        if not any(not isinstance(x, str) for x in _parse_gold(gold, self.timeout_s)):
            return f"math: label {gold!r} cannot be parsed as a math answer"
        # ... and reads a word as a product of one-letter symbols ('forty' = f*o*r*t*y), which no
        # answer would ever equal: a label in words is a data error, not an expression
        if _WORDS.fullmatch(gold.strip()) and gold.strip().lower() not in _MATH_WORDS:
            return (f"math: label {gold!r} is a word, not a math answer (it would read as a product of "
                    "symbols); write it as a number or expression, or use the `normalized` reward")
        return None


_WORDS = re.compile(r"[A-Za-z]{3,}(?:[ -][A-Za-z]+)*")
_MATH_WORDS = {"inf", "infty", "infinity", "oo", "pi", "nan"}


# ---- string matches ------------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_text(s: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD-style)."""
    return " ".join(_ARTICLES.sub(" ", s.lower().translate(_PUNCT)).split())


@dataclass
class ExactReward:
    """1.0 when the extracted answer equals the label exactly (outer whitespace ignored)."""

    weight: float = 1.0
    extract: Extract = "auto"
    needs_label = True

    def key(self, s: str) -> str:
        """What answer and label are compared as."""
        return s.strip()

    def __call__(self, prompt: dict[str, Any], sample: Sample) -> float:
        got = extract_answer(response_text(sample), self.extract)
        return float(got is not None and self.key(got) == self.key(str(prompt["label"])))

    def check_label(self, label: Any) -> str | None:
        return None if str(label).strip() else "exact: empty label"


@dataclass
class NormalizedReward(ExactReward):
    """1.0 when answer and label agree after `normalize_text` (case, punctuation, articles)."""

    def key(self, s: str) -> str:
        return normalize_text(s)

    def check_label(self, label: Any) -> str | None:
        return None if normalize_text(str(label)) else f"normalized: label {label!r} is empty once normalised"


@dataclass
class MultipleChoiceReward:
    """1.0 when the chosen letter equals the label's (labels: "B", "(B)" or a 0-based index).

    The choice is read from `\\boxed{}`, else "answer is (X)" / "Answer: X", else the last
    standalone valid letter in the response.
    """

    weight: float = 1.0
    letters: str = "ABCD"
    needs_label = True

    def __post_init__(self) -> None:
        if not self.letters or not self.letters.isalpha() or not self.letters.isupper():
            raise ConfigError(f"multiple_choice: letters must be upper-case letters, got {self.letters!r}")

    def letter_of(self, label: Any) -> str | None:
        if isinstance(label, int) and not isinstance(label, bool):
            return self.letters[label] if 0 <= label < len(self.letters) else None
        s = str(label).strip().strip("()").strip().upper()
        return s if len(s) == 1 and s in self.letters else None

    def choice(self, text: str) -> str | None:
        boxed = extract_boxed(text)
        if boxed is not None:
            return self.letter_of(boxed)
        cls = f"[{self.letters}{self.letters.lower()}]"
        m = re.findall(rf"answer(?: is)?\s*[:=]?\s*\(?({cls})\)?(?![A-Za-z])", text, flags=re.IGNORECASE)
        if m:
            return m[-1].upper()
        m = re.findall(rf"(?<![A-Za-z])\(?([{self.letters}])\)?(?![A-Za-z])", text)
        return m[-1] if m else None

    def __call__(self, prompt: dict[str, Any], sample: Sample) -> float:
        want = self.letter_of(prompt["label"])
        return float(want is not None and self.choice(response_text(sample)) == want)

    def check_label(self, label: Any) -> str | None:
        if self.letter_of(label) is None:
            return f"multiple_choice: label {label!r} is not one of the letters {self.letters!r} or an index"
        return None


@dataclass
class FormatReward:
    """1.0 when the response matches `pattern` (a Python regex); needs no label.

    The default asks for a final answer in an extractable form: `\\boxed{...}` or `#### ...`.
    """

    weight: float = 1.0
    pattern: str = r"\\boxed\{.+\}|####\s*\S+"
    match: Literal["search", "fullmatch"] = "search"
    needs_label = False

    def __post_init__(self) -> None:
        try:
            self._re = re.compile(self.pattern, re.DOTALL)
        except re.error as exc:
            raise ConfigError(f"format: pattern {self.pattern!r} is not a valid regex: {exc}") from exc

    def __call__(self, prompt: dict[str, Any], sample: Sample) -> float:
        text = response_text(sample).strip()
        hit = self._re.search(text) if self.match == "search" else self._re.fullmatch(text)
        return float(hit is not None)

    def check_label(self, label: Any) -> str | None:
        return None


RULE_REWARDS = Registry("reward", {
    "math": "miles.rollout.rewards.rules:MathReward",
    "exact": "miles.rollout.rewards.rules:ExactReward",
    "normalized": "miles.rollout.rewards.rules:NormalizedReward",
    "multiple_choice": "miles.rollout.rewards.rules:MultipleChoiceReward",
    "format": "miles.rollout.rewards.rules:FormatReward",
    "code_tests": "miles.rollout.rewards.code_tests:CodeTestsReward",
})


def build_rule_reward(spec: dict[str, Any], where: str = "rewards") -> RuleReward:
    """One reward from its table: `{type = NAME, weight = W, ...that type's options}`."""
    if "type" not in spec:
        raise ConfigError(f"{where}: each reward needs a `type`; valid: {', '.join(RULE_REWARDS.names())}")
    cls = RULE_REWARDS.get(str(spec["type"]))
    options = {k: v for k, v in spec.items() if k != "type"}
    try:
        return from_dict(cls, options)
    except ConfigError as exc:
        raise ConfigError(f"{where} (type {spec['type']!r}): {exc}") from exc


@dataclass
class CombinedReward:
    """The weighted sum of several rule rewards; awaitable only when one of them is."""

    parts: list[RuleReward]

    @property
    def needs_label(self) -> bool:
        return any(p.needs_label for p in self.parts)

    def __call__(self, prompt: dict[str, Any], sample: Sample) -> float | Awaitable[float]:
        values = [p(prompt, sample) for p in self.parts]
        weights = [float(getattr(p, "weight", 1.0)) for p in self.parts]
        if not any(inspect.isawaitable(v) for v in values):
            done = cast("list[float]", values)  # none is awaitable
            return sum(w * float(v) for w, v in zip(weights, done, strict=True))

        async def total() -> float:
            out = 0.0
            for w, v in zip(weights, values, strict=True):
                out += w * float(await v if inspect.isawaitable(v) else v)
            return out

        return total()

    def check_label(self, label: Any) -> str | None:
        for p in self.parts:
            if p.needs_label and (err := p.check_label(label)):
                return err
        return None


def build_rewards(specs: list[dict[str, Any]], where: str = "rewards") -> CombinedReward:
    if not specs:
        raise ConfigError(f"{where}: list at least one reward, e.g. [{{type = \"math\"}}]; "
                          f"valid types: {', '.join(RULE_REWARDS.names())}")
    return CombinedReward([build_rule_reward(s, f"{where}[{i}]") for i, s in enumerate(specs)])

