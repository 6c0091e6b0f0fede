"""What the environment-hub adapters (verifiers, OpenEnv, reasoning-gym) share.

- `require(module, extra)`: import an optional package lazily, or fail with an error that
  names the `miles[...]` extra to install.
- `chat_turn(ctx, messages, audit)`: one turn through the session, adding what the engine
  sampled to the trajectory's running count.
- `audited(reward)`: a reward that first checks the trajectory for token drift: the tokens
  the trainer trains on (loss mask 1) must be exactly the tokens the engine sampled over
  every turn, as the session answered each turn. The session store keeps the engine's ids
  as they are and tokenizes only what the environment appended (observations, tool
  results), so a finished run had 0 drift; a drifted trajectory raises `TokenDrift`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from miles.core.errors import ConfigError
from miles.rollout.envs.tool_math import TokenDrift, drift
from miles.rollout.layers import AgentContext, Prompt
from miles.rollout.types import Sample

__all__ = ["TokenDrift", "TurnCount", "audited", "chat_turn", "drift", "require"]


def require(module: str, extra: str, what: str) -> ModuleType:
    """`import module`, or a ConfigError naming the extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"{what} needs the {module!r} package: pip install 'miles[{extra}]' "
                          f"({type(exc).__name__}: {exc})") from exc


@dataclass
class TurnCount:
    """What one trajectory's turns sampled, summed as the session reported each turn."""

    sampled: int = 0
    turns: int = 0


async def chat_turn(ctx: AgentContext, messages: list[dict[str, Any]], count: TurnCount,
                    tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    reply = await ctx.client.chat(ctx.session_id, messages, tools if tools is not None else ctx.tools,
                                  ctx.sampling)
    count.sampled += int(reply.get("usage", {}).get("completion_tokens", 0))
    count.turns += 1
    return reply


HubReward = Callable[[Prompt, Sample], float | Awaitable[float]]


def audited(reward: HubReward) -> Callable[[Prompt, Sample], Awaitable[float]]:
    """`reward`, after the trajectory passed the token-drift audit (the agent must report
    `sampled_tokens`, as every hub adapter's agent does)."""

    async def checked(prompt: Prompt, sample: Sample) -> float:
        # a sample with no `sampled_tokens` did not come through a session (the evaluator's
        # greedy answers are the engine's output as is): nothing was spliced, nothing to audit
        d = drift(sample) if "sampled_tokens" in sample.metadata else 0
        if d:
            raise TokenDrift(f"prompt {prompt.get('id')!r}: {sum(sample.loss_mask)} trained tokens "
                             f"against {sample.metadata.get('sampled_tokens')} sampled ({d} drifted)")
        r = reward(prompt, sample)
        return float(await r) if inspect.isawaitable(r) else float(r)

    checked.__qualname__ = f"audited({getattr(reward, '__qualname__', 'reward')})"
    return checked
