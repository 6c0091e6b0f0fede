"""The learning gate's envs: the GSM8K cut by calculator steps, and the tool env's token audit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.core.errors import ConfigError
from miles.rollout.envs.gsm8k import calc_steps, make_env
from miles.rollout.envs.tool_math import SYSTEM, TokenDrift, audited_reward, drift
from miles.rollout.envs.tool_math import make_env as make_tool_env
from miles.rollout.types import Sample

pytestmark = pytest.mark.timeout(60)

ROWS = [
    {"question": "One step?", "answer": "2+3 = <<2+3=5>>5\n#### 5"},
    {"question": "Three steps?", "answer": "<<1+1=2>>2 <<2*3=6>>6 <<6-1=5>>5\n#### 5"},
    {"question": "No step?", "answer": "It is 7.\n#### 7"},
    {"question": "Two steps?", "answer": "<<4*4=16>>16 <<16/2=8>>8\n#### 8"},
]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    p = tmp_path / "train.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return p


def test_cut_keeps_rows_with_at_most_n_calculator_steps_in_file_order(data: Path) -> None:
    env = make_env(path=str(data), max_calc_steps=2, shuffle=False)
    got = [env.prompts.item(i)["messages"][-1]["content"] for i in range(3)]
    assert got == ["One step?", "No step?", "Two steps?"]
    assert env.prompts.item(3)["messages"][-1]["content"] == "One step?"  # the next epoch
    assert [calc_steps(r["answer"]) for r in ROWS] == [1, 3, 0, 2]
    assert len(make_env(path=str(data)).prompts.rows) == 4  # 0 = every row


def test_cut_labels_score_by_the_number_after_hashes(data: Path) -> None:
    env = make_env(path=str(data), max_calc_steps=1, shuffle=False)
    p = env.prompts.item(0)
    right = Sample(prompt_ids=[0], metadata={"response": "so the answer is #### 5"})
    wrong = Sample(prompt_ids=[0], metadata={"response": "#### 6"})
    assert env.reward(p, right) == 1.0 and env.reward(p, wrong) == 0.0


def test_cut_errors_name_the_problem(data: Path) -> None:
    with pytest.raises(ConfigError, match="max_calc_steps"):
        make_env(path=str(data), max_calc_steps=-1)
    one = data.parent / "hard.jsonl"
    one.write_text(json.dumps(ROWS[1]) + "\n")
    with pytest.raises(ConfigError, match="no row has at most 1"):
        make_env(path=str(one), max_calc_steps=1)


def test_tool_env_prompt_teaches_the_format() -> None:
    p = make_tool_env(seed=3).prompts.item(0)
    assert p["messages"][0] == {"role": "system", "content": SYSTEM}
    assert "<tool_call>" in SYSTEM and p["messages"][-1]["role"] == "user"
    assert p["id"].startswith("toolmath-")


def test_audit_passes_exact_trajectories_and_stops_a_drifted_one() -> None:
    prompt = {"id": "t", "answer": "65"}
    # two sampled turns (3 + 2 tokens) around a 2-token tool result that is not trained on
    ok = Sample(prompt_ids=[1, 2], response_ids=[5, 6, 7, 8, 9, 10, 11], loss_mask=[1, 1, 1, 0, 0, 1, 1],
                rollout_logprobs=[-0.1, -0.1, -0.1, 0.0, 0.0, -0.1, -0.1], versions=[0] * 7, metadata={"response": "65", "sampled_tokens": 5})
    assert drift(ok) == 0 and audited_reward(prompt, ok) == 1.0
    bad = Sample(prompt_ids=[1, 2], response_ids=[5, 6, 7], loss_mask=[1, 1, 1], rollout_logprobs=[-0.1] * 3, versions=[0] * 3,
                 metadata={"response": "65", "sampled_tokens": 4})
    assert drift(bad) == 1
    with pytest.raises(TokenDrift, match="3 trained tokens against 4 sampled"):
        audited_reward(prompt, bad)
    with pytest.raises(TokenDrift, match="sampled_tokens"):
        drift(Sample(prompt_ids=[1], metadata={}))
