"""The environment-hub adapters run for real: reasoning-gym's datasets and scorers, an OpenEnv
server on loopback driven through its client, verifiers tasksets (single-turn and with tools).

Each trajectory goes through the real session store and the tiny tokenizer. The policy is the
tests' stand-in for a model (`SumPolicy`: it reads the prompt ids and writes reply ids like an
engine); the adapters, the session store and the envs under test are real. Tests of a package
that is not installed skip and say which extra provides it.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from miles.core.errors import ConfigError
from miles.core.ports import group_port
from miles.rollout.envs.base import Environment
from miles.rollout.envs.hub_common import TokenDrift, drift, require
from miles.rollout.layers import RolloutContext, default_generate, default_rollout, load_layer
from miles.rollout.tito.client import EngineOutput, LocalSessionClient
from miles.rollout.tito.store import SessionStore
from miles.rollout.tokens.tiny_tokenizer import tiny_tokenizer
from miles.rollout.types import Group, Sample

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]


def _has(mod: str) -> bool:
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


needs_rg = pytest.mark.skipif(not _has("reasoning_gym"), reason="reasoning-gym not installed: pip install 'miles[reasoning-gym]'")
needs_openenv = pytest.mark.skipif(not _has("openenv"), reason="openenv-core not installed: pip install 'miles[openenv]'")
needs_vf = pytest.mark.skipif(not _has("verifiers"), reason="verifiers not installed: pip install 'miles[verifiers]'")


class SumPolicy:
    """The tests' stand-in model: answers "a + b" / "a * b + c" questions in the last user or
    tool message; `wrong_first` answers off by one on a trajectory's first turn; `tools` calls
    the verifiers example's `mul` then `add` tools before answering."""

    def __init__(self, tok: Any, wrong_first: bool = False, always_wrong: bool = False, tools: bool = False) -> None:
        self.tok, self.wrong_first, self.always_wrong, self.tools = tok, wrong_first, always_wrong, tools
        self.end = tok.token_to_id("<|im_end|>")

    def reply(self, text: str) -> str:
        turns = text.split("<|im_start|>")
        last = turns[-2]  # the message before the generation prompt
        first_turn = not any(t.startswith("assistant") for t in turns[:-1])
        if last.startswith("tool\n"):
            res = last[5:].split("<|im_end|>")[0]
            if self.tools and text.count("<|im_start|>tool") == 1:
                c = int(re.findall(r"\* \d+ \+ (\d+)\?", text)[-1])
                return f'<tool_call>{{"name": "add", "arguments": {{"a": {res}, "b": {c}}}}}</tool_call>'
            return res
        nums = [int(x) for x in re.findall(r"\d+", last.split("<|im_end|>")[0])]
        if self.tools and len(nums) >= 3:
            return f'<tool_call>{{"name": "mul", "arguments": {{"a": {nums[0]}, "b": {nums[1]}}}}}</tool_call>'
        if len(nums) < 2:  # "Not quite, try again.": the question is further up
            nums = [int(x) for x in re.findall(r"What is (\d+) \+ (\d+)", text)[-1]]
        ans = nums[0] + nums[1]
        if self.always_wrong or (self.wrong_first and first_turn):
            ans += 1
        return str(ans)

    async def __call__(self, prompt_ids: list[int], sampling: dict[str, Any], **_: Any) -> EngineOutput:
        ids = self.tok.encode(self.reply(self.tok.decode(prompt_ids))) + [self.end]
        return EngineOutput(ids, [-0.25] * len(ids), "stop")


@pytest.fixture
def tok(tmp_path: Path) -> Any:
    return tiny_tokenizer(tmp_path)


async def rollout(env: Environment, policy: SumPolicy, tok: Any, prompt_index: int = 0, n: int = 4,
                  max_turns: int = 4) -> Group:
    client = LocalSessionClient(SessionStore(tok), policy)
    ctx = RolloutContext(client, default_generate, load_layer("agent", env.agent), env.reward, n, env.tools,
                         {"max_new_tokens": 32}, max_turns)
    return await default_rollout(ctx, env.prompts.item(prompt_index))


def test_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for mod, extra in [("reasoning_gym", "reasoning-gym"), ("openenv.core", "openenv"), ("verifiers.v1", "verifiers")]:
        monkeypatch.setitem(sys.modules, mod, None)  # `import mod` now raises ImportError
        with pytest.raises(ConfigError, match=re.escape(f"pip install 'miles[{extra}]'")):
            require(mod, extra, "the test env")
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    from miles.rollout.envs.reasoning_gym_env import make_env

    with pytest.raises(ConfigError, match=re.escape("miles[reasoning-gym]")):
        make_env("basic_arithmetic")


def test_drift_audit_refuses_a_drifted_trajectory() -> None:
    from miles.rollout.envs.hub_common import audited

    reward = audited(lambda p, s: 1.0)
    bad = Sample(prompt_ids=[1], response_ids=[2, 3], loss_mask=[1, 1], rollout_logprobs=[0.0, 0.0],
                 versions=[0, 0], metadata={"sampled_tokens": 3})
    assert drift(bad) == 1
    with pytest.raises(TokenDrift, match="2 trained tokens against 3 sampled"):
        import asyncio

        asyncio.run(reward({"id": "p"}, bad))


# -- reasoning-gym --------------------------------------------------------------------------
RG_CFG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
          "allow_parentheses": False, "allow_negation": False}


@needs_rg
async def test_reasoning_gym_prompts_and_rewards_come_from_the_package(tok: Any) -> None:
    import reasoning_gym

    from miles.rollout.envs.reasoning_gym_env import make_env

    env = make_env("basic_arithmetic", RG_CFG, seed=5, size=50)
    ds = reasoning_gym.create_dataset("basic_arithmetic", **RG_CFG, seed=5, size=50)
    p = env.prompts.item(52)  # the next epoch: entry 2
    assert p["messages"][-1]["content"] == ds[2]["question"] and p["answer"] == ds[2]["answer"]
    good = await rollout(env, SumPolicy(tok), tok, 2)
    assert [s.reward for s in good.samples] == [1.0] * 4
    assert all(drift(s) == 0 and s.metadata["sampled_tokens"] == sum(s.loss_mask) for s in good.samples)
    bad = await rollout(env, SumPolicy(tok, always_wrong=True), tok, 2)
    want = ds.score_answer(bad.samples[0].metadata["response"], ds[2])
    assert [s.reward for s in bad.samples] == [want] * 4 and want < 1.0


@needs_rg
def test_reasoning_gym_bad_task_is_a_config_error() -> None:
    from miles.rollout.envs.reasoning_gym_env import make_env

    with pytest.raises(ConfigError, match="no_such_task"):
        make_env("no_such_task")
    with pytest.raises(ConfigError, match="size must be >= 1"):
        make_env("basic_arithmetic", size=0)


# -- OpenEnv ---------------------------------------------------------------------------------
@pytest.fixture
def openenv_url(tmp_path: Path) -> Iterator[str]:
    """The example OpenEnv server (examples/openenv_sum_env.py) on a free loopback port."""
    port = group_port()  # the server binds it later: picked where no connection takes it meanwhile
    log = (tmp_path / "openenv.log").open("wb")
    proc = subprocess.Popen([sys.executable, str(REPO / "examples" / "openenv_sum_env.py"), "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "openenv.log").read_text()[-2000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "openenv server did not start"
                time.sleep(0.3)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


@needs_openenv
async def test_openenv_episode_runs_to_the_envs_done_with_its_reward(tok: Any, openenv_url: str) -> None:
    from miles.rollout.envs.openenv_env import make_env

    env = make_env(openenv_url, seed=3, observation_field="prompt")
    g = await rollout(env, SumPolicy(tok, wrong_first=True), tok)
    for s in g.samples:  # wrong, "Not quite, try again.", right: reward 1 at the env's done
        assert s.reward == 1.0 and s.metadata["env_done"] and s.metadata["env_steps"] == 2
        assert drift(s) == 0 and s.metadata["turns"] == 2
        runs = "".join(map(str, s.loss_mask)).strip("0").split("0")
        assert len([r for r in runs if r]) == 2  # two sampled spans, the observation between masked
        assert "Not quite, try again." in tok.decode(s.response_ids)
    assert len({tuple(s.prompt_ids) for s in g.samples}) == 1  # one seed: the group shares its question
    g = await rollout(env, SumPolicy(tok, always_wrong=True), tok, max_turns=5)
    assert all(s.reward == 0.0 and s.metadata["env_done"] and s.metadata["env_steps"] == 3 for s in g.samples)


@needs_openenv
def test_openenv_config_errors(openenv_url: str) -> None:
    from miles.rollout.envs.openenv_env import make_env, observation_text

    with pytest.raises(ConfigError, match="base_url"):
        make_env("localhost:1")
    with pytest.raises(ConfigError, match="cannot import"):
        make_env(openenv_url, client="no_such_pkg:Client")
    with pytest.raises(ConfigError, match="'nope' is not in the observation"):
        observation_text({"prompt": "x"}, "nope")
    assert json.loads(observation_text({"prompt": "x", "reward": 0, "done": False}, "")) == {"prompt": "x"}


# -- verifiers -------------------------------------------------------------------------------
@needs_vf
async def test_verifiers_single_turn_scored_by_the_tasks_reward(tok: Any) -> None:
    from miles.rollout.envs.verifiers_env import make_env

    env = make_env("miles.examples.verifiers_sums:SumTaskset", {"max_operand": 9}, size=20)
    task = env.prompts.task(4)
    assert env.prompts.item(4)["messages"] == [{"role": "user", "content": task.data.prompt}]
    g = await rollout(env, SumPolicy(tok), tok, 4)
    assert all(s.reward == 1.0 and s.metadata["vf_rewards"] == {"correct": 1.0} and drift(s) == 0 for s in g.samples)
    g = await rollout(env, SumPolicy(tok, always_wrong=True), tok, 4)
    assert all(s.reward == 0.0 for s in g.samples)
    # the evaluator's answers carry only the reply text: scored the same way
    s = Sample(prompt_ids=[1], response_ids=[2], loss_mask=[1], rollout_logprobs=[0.0], versions=[0],
               metadata={"response": str(task.data.answer)})
    assert await env.reward(env.prompts.item(4), s) == 1.0


@needs_vf
async def test_verifiers_multi_turn_runs_the_tasksets_tools(tok: Any) -> None:
    from miles.rollout.envs.verifiers_env import make_env

    env = make_env("miles.examples.verifiers_sums:ToolSumTaskset", size=10)
    assert env.tools and {t["function"]["name"] for t in env.tools} == {"add", "mul"}
    g = await rollout(env, SumPolicy(tok, tools=True), tok, 1, max_turns=5)
    answer = env.prompts.task(1).data.answer
    for s in g.samples:
        assert s.metadata["turns"] == 3 and s.metadata["response"] == str(answer) and s.reward == 1.0
        assert drift(s) == 0 and s.metadata["sampled_tokens"] == sum(s.loss_mask)


@needs_vf
def test_verifiers_bad_taskset_is_a_config_error() -> None:
    from miles.rollout.envs.verifiers_env import make_env

    with pytest.raises(ConfigError, match="taskset is required"):
        make_env("")
    with pytest.raises(ConfigError, match="not a verifiers.v1.Taskset"):
        make_env("miles.examples.verifiers_sums:last_number")
    with pytest.raises(ConfigError, match="no_such_taskset"):
        make_env("no_such_taskset")
