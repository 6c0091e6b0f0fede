"""GSM8K's strict and lenient eval scorers on answers written the ways models write them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.rollout.envs.gsm8k import (
    lenient_answer,
    make_env,
    score_lenient,
    score_strict,
    strict_answer,
)

pytestmark = pytest.mark.timeout(60)
DATA = Path(__file__).resolve().parents[1] / "data" / "gsm8k_like"


def label(n: int) -> dict[str, str]:
    rows = [json.loads(ln) for ln in (DATA / "test.jsonl").read_text().splitlines()]
    return {"label": rows[n]["answer"]}


# (test row, response, strict, lenient); row 0's answer is 10, row 2's 150, row 3's 18
CASES = [
    (0, "The apples cost 5*2 = 10 dollars.\nHis change is 20 - 10 = 10 dollars.\n#### 10", 1.0, 1.0),
    (0, "5 apples at $2 is $10, so the change from $20 is $10.", 0.0, 1.0),  # right, but no ####
    (0, "The change is 10 dollars.\n#### $10.00", 1.0, 1.0),
    (0, "#### 10\nThat leaves 0 apples unpaid.", 1.0, 0.0),  # a number after the final answer
    (0, "20-10 gives the change: 10", 0.0, 1.0),
    (0, "#### 12\nWait, 20-10=10.", 0.0, 1.0),
    (2, "60 * 2.5 = 150 miles\n####150 miles", 1.0, 1.0),
    (2, "It goes 60*2.5=150.0 miles.\n#### 150.0", 1.0, 1.0),
    (2, "#### 1,50", 0.0, 0.0),  # "1" then a comma: not 150
    (3, "14+9=23 and 23-5=18 #### 18 #### 19", 0.0, 0.0),  # the last #### counts
    (3, "She has eighteen stickers.", 0.0, 0.0),
    (3, "", 0.0, 0.0),
]


@pytest.mark.parametrize(("row", "response", "strict", "lenient"), CASES)
def test_strict_and_lenient(row: int, response: str, strict: float, lenient: float) -> None:
    assert score_strict(label(row), response) == strict
    assert score_lenient(label(row), response) == lenient


def test_number_forms() -> None:
    assert strict_answer("so #### 3,600") == 3600.0
    assert strict_answer("#### -4 degrees") == -4.0
    assert strict_answer("no final answer 7") is None
    assert lenient_answer("16-3-4=9") == 9.0  # a minus after a digit is subtraction
    assert lenient_answer("it is -5 now") == -5.0
    assert lenient_answer("costs $1,234.50.") == 1234.5
    assert lenient_answer("none") is None


def test_labels_with_thousands_separators_and_the_env_carries_both_scorers() -> None:
    env = make_env(path=str(DATA / "train.jsonl"), eval_path=str(DATA / "test.jsonl"), split="eval")
    assert sorted(env.scorers) == ["lenient", "strict"]
    ann = {"label": [json.loads(ln) for ln in (DATA / "train.jsonl").read_text().splitlines()][5]["answer"]}
    assert ann["label"].endswith("#### 3,600")
    assert env.scorers["strict"](ann, "She saves 3600 dollars.\n#### 3600") == 1.0
    assert env.scorers["lenient"](ann, "1200*3 = 3,600") == 1.0
    assert len(env.prompts) == 5  # type: ignore[arg-type]  # a finite eval set: the full evaluation's rows


# (test row, response, strict under answer_format = "boxed"); row 0's answer is 10, row 3's 18
BOXED = [
    (0, "The change is 20 - 10 = 10 dollars.\n\nThe answer is $\\boxed{10}$.", 1.0),
    (0, "So he gets \\boxed{\\$10} back.", 1.0),
    (0, "\\boxed{10 \\text{ dollars}}", 1.0),
    (0, "The change is 10 dollars.\n#### 10", 0.0),  # right, but not in the asked-for place
    (0, "First \\boxed{12}, no: \\boxed{10}", 1.0),  # the last box counts
    (0, "\\boxed{10}, no wait, \\boxed{12}", 0.0),
    (3, "\\boxed{18", 0.0),  # cut off before the closing brace
    (3, "\\boxed{}", 0.0),
]


@pytest.mark.parametrize(("row", "response", "strict"), BOXED)
def test_boxed_answer_format_scores_the_last_box(row: int, response: str, strict: float) -> None:
    env = make_env(path=str(DATA / "train.jsonl"), eval_path=str(DATA / "test.jsonl"), split="eval",
                   answer_format="boxed")
    assert env.scorers["strict"](label(row), response) == strict
    assert env.scorers["lenient"](label(row), "the answer: 10") == float(row == 0)


def test_an_unknown_answer_format_is_refused_with_the_choices() -> None:
    from miles.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"answer_format must be one of \['boxed', 'hash'\].*'latex'"):
        make_env(path=str(DATA / "train.jsonl"), answer_format="latex")
