"""Contracts of the agent, generate and rollout layers, run on the built-in environments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from miles.core.errors import ConfigError, ProtocolError
from miles.rollout.envs import arithmetic, calculator, openai_agent
from miles.rollout.layers import (
    AgentContext,
    GenerateContext,
    RolloutContext,
    check_layer,
    default_generate,
    default_rollout,
    load_layer,
    single_turn_agent,
    validate_group,
)
from miles.rollout.tito.client import LocalSessionClient, SessionClient
from miles.rollout.tito.store import SessionStore
from miles.rollout.tokens.tiny_tokenizer import tiny_tokenizer
from miles.rollout.types import Group

from .scripted_policy import ScriptedPolicy


def _client(tmp: Path, **kw: Any) -> tuple[LocalSessionClient, ScriptedPolicy]:
    tok = tiny_tokenizer(tmp)
    policy = ScriptedPolicy(tok, **kw)
    return LocalSessionClient(SessionStore(tok), policy), policy


async def bad_arity(ctx: Any, extra: Any, more: Any) -> None:
    return None


def sync_agent(ctx: Any) -> None:
    return None


def test_check_layer_signatures() -> None:
    check_layer("agent", single_turn_agent)
    check_layer("generate", default_generate)
    check_layer("rollout", default_rollout)
    assert load_layer("rollout", "miles.rollout.layers:default_rollout") is default_rollout
    with pytest.raises(ConfigError, match=r"rollout.agent_fn: .*must be an `async def`"):
        check_layer("agent", sync_agent)
    with pytest.raises(ConfigError, match=r"rollout.rollout_fn: .*wrong signature.*RolloutContext"):
        check_layer("rollout", bad_arity)
    with pytest.raises(ConfigError, match="cannot import module"):
        load_layer("generate", "miles.nope:gen")


async def test_agent_layer_single_turn(tmp_path: Path) -> None:
    client, _ = _client(tmp_path)
    assert isinstance(client, SessionClient)
    env = arithmetic.make_env(seed=1)
    p = env.prompts.next()
    sid = await client.create_session()
    info = await single_turn_agent(AgentContext(client, sid, p))
    assert info["response"] == p["answer"]
    (s,) = await client.export(sid)
    assert s.num_sampled == len(p["answer"]) + 1


async def test_generate_layer_one_trajectory(tmp_path: Path) -> None:
    client, _ = _client(tmp_path)
    env = calculator.make_env(seed=3)
    p = env.prompts.next()
    out = await default_generate(GenerateContext(client, p, calculator.calculator_agent, env.tools))
    (s,) = out
    assert s.metadata["turns"] == 2 and s.metadata["response"] == f"The answer is {p['answer']}"
    assert 0 in s.loss_mask and s.loss_mask[-1] == 1  # the tool result is spliced with mask 0
    assert len(client.store) == 0  # the session was closed


async def test_rollout_layer_group_with_rewards(tmp_path: Path) -> None:
    client, _ = _client(tmp_path, wrong_every=2)
    env = arithmetic.make_env(seed=0)
    p = env.prompts.next()
    ctx = RolloutContext(client, default_generate, single_turn_agent, env.reward, n_samples=4)
    g = await default_rollout(ctx, p)
    assert isinstance(g, Group) and len(g) == 4 and g.prompt_id == p["id"]
    assert sorted(g.rewards) == [0.0, 0.0, 1.0, 1.0]
    assert [s.index for s in g.samples] == [0, 1, 2, 3]
    validate_group(g, 4, p)
    with pytest.raises(ProtocolError, match="expected at least n_samples_per_prompt=5"):
        validate_group(g, 5, p)
    with pytest.raises(ProtocolError, match="expected a Group"):
        validate_group([], 1, p)


async def test_rollout_layer_marks_failed_generation(tmp_path: Path) -> None:
    client, _ = _client(tmp_path, fail_on="=")
    env = arithmetic.make_env()
    ctx = RolloutContext(client, default_generate, single_turn_agent, env.reward, n_samples=2)
    g = await default_rollout(ctx, env.prompts.next())
    assert g.failed() and "engine failed" in g.samples[0].metadata["error"]
    assert len(client.store) == 0


async def test_openai_agent_needs_http_front(tmp_path: Path) -> None:
    client, _ = _client(tmp_path)
    env = openai_agent.make_env()
    check_layer("agent", openai_agent.openai_agent)
    sid = await client.create_session()
    with pytest.raises(ConfigError, match="HTTP front"):
        await openai_agent.openai_agent(AgentContext(client, sid, env.prompts.next(), env.tools))
