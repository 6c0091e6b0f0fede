"""An OpenEnv environment, unchanged, driven through its client: reset, then one step per turn,
with the environment's own reward and done.

    [rollout]
    env = "miles.rollout.envs.openenv_env:make_env"
    env_args = {base_url = "http://127.0.0.1:8011", action_field = "message", observation_field = "prompt"}

Each trajectory opens its own client session (`openenv.core.GenericEnvClient`, or the env's
typed client named by `client`) on the running server and calls `reset(seed=...)`; the n
trajectories of one prompt share its seed, so a group starts from the same state wherever the
env honours the seed. The observation becomes a user message (`observation_field` of it, or
the whole observation as JSON), the model's reply becomes the action (`{action_field: reply}`),
and the loop runs until the env says done or `rollout.max_turns` turns. The reward is the sum
of the env's step rewards (`reward_sum = false`: the last step's). Every turn goes through the
session store, so the trained ids and logprobs are the engine's and the observations are
appended as loss-masked tokens; each trajectory passes the token-drift audit before its reward
counts (rollout/envs/hub_common.py). An env that does not end within max_turns is scored as it
stands (metadata `env_done` false). Needs `pip install 'miles[openenv]'`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from miles.core.errors import ConfigError
from miles.core.hooks import resolve_hook
from miles.rollout.envs.base import Environment, SeededPrompts
from miles.rollout.envs.hub_common import TurnCount, audited, chat_turn, require
from miles.rollout.layers import AgentContext, Prompt
from miles.rollout.types import Sample

EXTRA = "openenv"
GENERIC_CLIENT = "openenv.core:GenericEnvClient"


@dataclass
class OpenEnvPrompts(SeededPrompts):
    """Prompt i is an episode seed (the env makes the task at reset) plus how to reach it."""

    env_name = "openenv"

    base_url: str = ""
    seed: int = 0
    client: str = GENERIC_CLIENT
    action_field: str = "message"
    observation_field: str = ""
    system_prompt: str = ""
    reward_sum: bool = True
    reset_args: dict[str, Any] | None = None
    position: int = 0

    def item(self, i: int) -> Prompt:
        conn = {"base_url": self.base_url, "client": self.client, "action_field": self.action_field,
                "observation_field": self.observation_field, "reward_sum": self.reward_sum,
                "reset_args": dict(self.reset_args or {})}
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return {"id": f"openenv-{self.seed}-{i}", "index": i, "env_seed": self.seed * 1_000_003 + i,
                "openenv": conn, "messages": system}


def observation_text(obs: Any, field: str) -> str:
    """What the model reads of an observation: one field of it, or all of it as JSON."""
    data = obs.model_dump() if hasattr(obs, "model_dump") else obs
    if not isinstance(data, dict):
        return str(data)
    if field:
        if field not in data:
            raise ConfigError(f"openenv env: observation_field {field!r} is not in the observation "
                              f"(fields: {sorted(data)})")
        return str(data[field])
    rest = {k: v for k, v in data.items() if k not in ("reward", "done", "metadata")}
    return json.dumps(rest, sort_keys=True, default=str)


def make_client(conn: dict[str, Any]) -> Any:
    require("openenv.core", EXTRA, "the openenv env")
    cls = resolve_hook(conn["client"], "rollout.env_args.client")
    return cls(base_url=conn["base_url"])


async def openenv_agent(ctx: AgentContext) -> dict[str, Any]:
    """reset, then (model turn -> env step) until done or max_turns."""
    conn = ctx.prompt["openenv"]
    env = make_client(conn)
    messages = list(ctx.prompt["messages"])
    count = TurnCount()
    total = last = 0.0
    done, steps, reply_text, finish = False, 0, "", "stop"
    try:
        await env.connect()
        res = await env.reset(seed=ctx.prompt["env_seed"], **conn["reset_args"])
        messages.append({"role": "user", "content": observation_text(res.observation, conn["observation_field"])})
        for _ in range(ctx.max_turns):
            reply = await chat_turn(ctx, messages, count)
            msg = reply["message"]
            reply_text, finish = msg.get("content") or "", reply["finish_reason"]
            messages.append(msg)  # as the session stored it (split reasoning, parsed tool calls)
            res = await env.step({conn["action_field"]: reply_text})
            steps += 1
            last = float(res.reward or 0.0)
            total += last
            done = bool(res.done)
            if done:
                break
            messages.append({"role": "user",
                             "content": observation_text(res.observation, conn["observation_field"])})
    finally:
        await env.close()
    return {"response": reply_text, "finish_reason": finish, "turns": count.turns, "sampled_tokens": count.sampled,
            "env_reward": total if conn["reward_sum"] else last, "env_done": done, "env_steps": steps}


def env_reward(prompt: Prompt, sample: Sample) -> float:
    if "env_reward" not in sample.metadata:
        raise ConfigError("openenv env: the sample carries no env_reward; its reward comes from the env's "
                          "steps, so use the env's agent (miles.rollout.envs.openenv_env:openenv_agent)")
    return float(sample.metadata["env_reward"])


def make_env(base_url: str = "", seed: int = 0, client: str = GENERIC_CLIENT, action_field: str = "message",
             observation_field: str = "", system_prompt: str = "", reward_sum: bool = True,
             reset_args: dict[str, Any] | None = None) -> Environment:
    if not base_url.startswith(("http://", "https://", "ws://", "wss://")):
        raise ConfigError(f"openenv env: base_url must be the env server's http(s):// or ws(s):// URL, "
                          f"got {base_url!r}")
    require("openenv.core", EXTRA, "the openenv env")
    resolve_hook(client, "rollout.env_args.client")  # a bad client path fails at start-up
    prompts = OpenEnvPrompts(base_url, seed, client, action_field, observation_field, system_prompt,
                             reward_sum, reset_args)
    return Environment("openenv", prompts, audited(env_reward), "miles.rollout.envs.openenv_env:openenv_agent")
