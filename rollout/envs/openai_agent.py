"""A black-box agent written only against the `openai` client (example).

It knows nothing of miles: it gets an OpenAI-compatible base URL (the session
server's per-session endpoint) and runs the calculator tool loop through
`AsyncOpenAI.chat.completions.create`. The session server records exact token
ids behind it. `openai` is imported lazily; it is needed only by this example.
"""

from __future__ import annotations

from typing import Any

from miles.core.errors import ConfigError
from miles.rollout.envs.base import Environment
from miles.rollout.envs.calculator import CALC_TOOL, CalculatorPrompts, run_tool
from miles.rollout.layers import AgentContext
from miles.rollout.rewards.builtin import last_number_reward


async def run_openai_tool_loop(base_url: str, messages: list[dict[str, Any]], max_turns: int = 8,
                               model: str = "policy", api_key: str = "miles-local",
                               **sampling: Any) -> dict[str, Any]:
    """The agent proper: plain OpenAI client code, usable against any compatible server."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    msgs = list(messages)
    content, finish, turns = "", "stop", 0
    try:
        for turns in range(1, max_turns + 1):  # noqa: B007 - turns is reported below
            resp = await client.chat.completions.create(model=model, messages=msgs,
                                                        tools=[CALC_TOOL], **sampling)
            choice = resp.choices[0]
            msg = choice.message
            content, finish = msg.content or "", choice.finish_reason or "stop"
            entry: dict[str, Any] = {"role": "assistant", "content": content}
            if msg.tool_calls:
                entry["tool_calls"] = [c.model_dump() for c in msg.tool_calls]
            msgs.append(entry)
            if not msg.tool_calls:
                break
            for c in entry["tool_calls"]:
                msgs.append({"role": "tool", "tool_call_id": c["id"], "content": run_tool(c)})
    finally:
        await client.close()
    return {"response": content, "turns": turns, "finish_reason": finish}


async def openai_agent(ctx: AgentContext) -> dict[str, Any]:
    if ctx.base_url is None:
        raise ConfigError("openai_agent needs the session server's HTTP front (its client has no base_url)")
    sampling = {k: v for k, v in ctx.sampling.items() if k in ("temperature", "top_p", "max_tokens")}
    return await run_openai_tool_loop(ctx.base_url, ctx.prompt["messages"], ctx.max_turns, api_key=ctx.api_key,
                                      **sampling)


def make_env(seed: int = 0, max_operand: int = 99) -> Environment:
    return Environment("openai_calculator", CalculatorPrompts(seed, max_operand), last_number_reward,
                       "miles.rollout.envs.openai_agent:openai_agent", [CALC_TOOL])
