"""Rewards, the dynamic-sampling filter and the environments' data and tools."""

from __future__ import annotations

import pytest

from miles.core.errors import ConfigError
from miles.rollout.envs.arithmetic import ArithmeticPrompts
from miles.rollout.envs.calculator import run_tool, safe_eval
from miles.rollout.filters import check_verdict, dynamic_sampling, load_filter
from miles.rollout.rewards.builtin import (
    exact_answer,
    format_reward,
    last_number,
    last_number_reward,
)
from miles.rollout.types import Group, Sample


def _s(text: str, reward: float | None = None) -> Sample:
    return Sample(prompt_ids=[1], reward=reward, metadata={"response": text})


def test_math_rewards() -> None:
    p = {"answer": "42"}
    assert exact_answer(p, _s(" 42. ")) == 1.0 and exact_answer(p, _s("42 apples")) == 0.0
    assert last_number("a 1, then 2,000 and -3.5") == -3.5 and last_number("none") is None
    assert last_number_reward(p, _s("so it is 42")) == 1.0
    assert last_number_reward(p, _s("42 or 41")) == 0.0
    assert format_reward("-12") == 1.0 and format_reward("12 apples") == 0.0


def test_dynamic_sampling_filter() -> None:
    same = Group("p", [_s("", 1.0), _s("", 1.0)])
    mixed = Group("q", [_s("", 1.0), _s("", 0.0)])
    assert dynamic_sampling(same) == (False, "zero_std")
    assert dynamic_sampling(mixed) == (True, "")
    assert load_filter("")(same) == (True, "")
    assert load_filter("miles.rollout.filters:dynamic_sampling") is dynamic_sampling
    with pytest.raises(ConfigError, match=r"must return \(keep: bool, reason: str\)"):
        check_verdict(False, "buffer.filter_fn")
    with pytest.raises(ConfigError, match="drop reason ''"):
        check_verdict((False, ""), "buffer.filter_fn")


def test_arithmetic_prompts_are_deterministic_and_resumable() -> None:
    a = ArithmeticPrompts(seed=5)
    first = [a.next() for _ in range(10)]
    assert all(eval(p["question"][:-1]) == int(p["answer"]) for p in first)  # noqa: S307
    st = a.state()
    nxt = a.next()
    b = ArithmeticPrompts(seed=5)
    b.load_state(st)
    assert b.next() == nxt and ArithmeticPrompts(seed=5).item(3) == first[3]
    assert ArithmeticPrompts(seed=6).item(0) != first[0] or ArithmeticPrompts(seed=6).item(1) != first[1]
    with pytest.raises(ConfigError, match="checkpoint seed"):
        ArithmeticPrompts(seed=1).load_state(st)
    with pytest.raises(ConfigError, match="ops"):
        ArithmeticPrompts(ops="^")


def test_calculator_tool() -> None:
    assert safe_eval("12*7+(3-1)") == 86
    for bad in ("__import__('os')", "2**10", "a+1"):
        with pytest.raises(ValueError):
            safe_eval(bad)
    call = {"function": {"name": "calc", "arguments": '{"expr": "6/4"}'}}
    assert run_tool(call) == "1.5"
    assert run_tool({"function": {"name": "calc", "arguments": '{"expr": "1/0"}'}}).startswith("error")
    assert "unknown tool" in run_tool({"function": {"name": "rm"}})
