"""The CPU learning gate's env (rollout/envs/chat_sums.py): held-out prompts, its reward and
the deliberately wrong reward the gate's self-check trains on."""

from __future__ import annotations

import pytest

from miles.core.errors import ConfigError
from miles.rollout.envs.chat_sums import ChatSumsPrompts, inverted_reward, make_env
from miles.rollout.types import Sample

pytestmark = pytest.mark.timeout(30)


def _s(text: str) -> Sample:
    return Sample(prompt_ids=[1], metadata={"response": text})


def test_prompts_are_chat_sums_and_a_seed_is_its_own_set() -> None:
    train, held_out = ChatSumsPrompts(seed=0), ChatSumsPrompts(seed=1_000_003)
    p = train.item(5)
    a, b = (int(x) for x in p["question"].removeprefix("What is ").split("?")[0].split(" plus "))
    assert p["answer"] == str(a + b) and 0 <= a <= 20 and 0 <= b <= 20
    assert p["messages"] == [{"role": "user", "content": p["question"]}]
    assert ChatSumsPrompts(seed=0).item(5) == p  # a pure function of (seed, i)
    assert [train.item(i)["question"] for i in range(32)] != [held_out.item(i)["question"] for i in range(32)]
    first = train.next()
    assert first == train.item(0) and train.position == 1


def test_rewards_score_the_last_number_and_the_break_inverts_it() -> None:
    env = make_env()
    p = {"answer": "25"}
    assert env.reward(p, _s("7 + 18 = 25")) == 1.0 and env.reward(p, _s("7 + 18 = 24")) == 0.0
    assert env.reward(p, _s("To find 7 plus 18, we")) == 0.0
    assert inverted_reward(p, _s("7 + 18 = 26")) == 1.0 and inverted_reward(p, _s("7 + 18 = 25")) == 0.0
    assert inverted_reward(p, _s("To find 7 plus 18, we")) == 1.0


def test_bad_operand_range_is_named() -> None:
    with pytest.raises(ConfigError, match="max_operand must be >= 1, got 0"):
        make_env(max_operand=0)
