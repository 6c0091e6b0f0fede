"""The three nested rollout layers and their plug-in contracts.

- **agent** `async def agent(ctx: AgentContext) -> dict | None`: a multi-turn
  harness; talks to its session through `ctx.client` (or, as a black box, to
  `ctx.base_url` with an OpenAI client); returns info for the reward (e.g. the answer).
- **generate** `async def generate(ctx: GenerateContext) -> list[Sample]`: one
  trajectory: open a session, run the agent, export the session's samples
  (one per leaf; one for a linear session), close it.
- **rollout** `async def rollout(ctx: RolloutContext, prompt: dict) -> Group`:
  the n samples of one prompt, each with a reward.

Each is named by import path in the config (`rollout.agent_fn`, `rollout.generate_fn`,
`rollout.rollout_fn`); `check_layer` verifies the signature at start-up and the
`validate_*` functions check what a plug-in returned, naming the layer at fault.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from miles.core.errors import ConfigError, ProtocolError
from miles.core.hooks import resolve_hook
from miles.rollout.tito.client import SessionClient
from miles.rollout.types import Group, Sample

Prompt = dict[str, Any]  # {"id": str, "index": int, "messages": [...], ...env fields (e.g. "answer")}
RewardFn = Callable[[Prompt, Sample], float | Awaitable[float]]


@dataclass
class AgentContext:
    client: SessionClient
    session_id: str
    prompt: Prompt
    tools: list[dict[str, Any]] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 8

    @property
    def base_url(self) -> str | None:
        return self.client.base_url(self.session_id)

    @property
    def api_key(self) -> str:
        """The bearer token an OpenAI client sends to `base_url` (a placeholder when the front
        requires none: the client library insists on one)."""
        return str(getattr(self.client, "api_key", "") or "miles-local")


AgentFn = Callable[[AgentContext], Awaitable[dict[str, Any] | None]]


@dataclass
class GenerateContext:
    client: SessionClient
    prompt: Prompt
    agent: AgentFn
    tools: list[dict[str, Any]] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    sample_index: int = 0
    max_turns: int = 8


GenerateFn = Callable[[GenerateContext], Awaitable[list[Sample]]]


@dataclass
class RolloutContext:
    client: SessionClient
    generate: GenerateFn
    agent: AgentFn
    reward: RewardFn
    n_samples: int = 1
    tools: list[dict[str, Any]] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 8


RolloutFn = Callable[[RolloutContext, Prompt], Awaitable[Group]]

_ARITY = {"agent": 1, "generate": 1, "rollout": 2}


def check_layer(kind: str, fn: Any, where: str = "") -> None:
    """Check that `fn` can serve as the `kind` layer: an async function of the right arity."""
    if kind not in _ARITY:
        raise ConfigError(f"unknown rollout layer {kind!r}; valid: {', '.join(_ARITY)}")
    label = where or f"rollout.{kind}_fn"
    name = getattr(fn, "__qualname__", repr(fn))
    if not callable(fn):
        raise ConfigError(f"{label}: {name} is not callable")
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", fn)  # noqa: B004
    if not inspect.iscoroutinefunction(target):
        raise ConfigError(f"{label}: {name} must be an `async def` ({_signature_doc(kind)})")
    try:
        inspect.signature(fn).bind(*([None] * _ARITY[kind]))
    except TypeError as exc:
        raise ConfigError(f"{label}: {name} has the wrong signature ({exc}); expected {_signature_doc(kind)}") from exc


def _signature_doc(kind: str) -> str:
    return {"agent": "async def agent(ctx: AgentContext) -> dict | None",
            "generate": "async def generate(ctx: GenerateContext) -> list[Sample]",
            "rollout": "async def rollout(ctx: RolloutContext, prompt: dict) -> Group"}[kind]


def load_layer(kind: str, path: str) -> Any:
    fn = resolve_hook(path, f"rollout.{kind}_fn")
    check_layer(kind, fn)
    return fn


def validate_agent_output(out: Any) -> dict[str, Any]:
    if out is None:
        return {}
    if not isinstance(out, dict):
        raise ProtocolError(f"agent layer returned {type(out).__name__}; expected a dict or None")
    return out


def validate_generate_output(out: Any) -> list[Sample]:
    if not isinstance(out, list) or not out or not all(isinstance(s, Sample) for s in out):
        got = type(out).__name__ if not isinstance(out, list) else f"list of {len(out)}"
        raise ProtocolError(f"generate layer returned {got}; expected a non-empty list[Sample]")
    return out


def validate_group(out: Any, n_samples: int, prompt: Prompt) -> Group:
    if not isinstance(out, Group):
        raise ProtocolError(f"rollout layer returned {type(out).__name__} for prompt "
                            f"{prompt.get('id')!r}; expected a Group")
    if len(out.samples) < n_samples:
        raise ProtocolError(f"rollout layer returned {len(out.samples)} samples for prompt "
                            f"{prompt.get('id')!r}; expected at least n_samples_per_prompt={n_samples}")
    for i, s in enumerate(out.samples):
        if s.reward is None and s.status in ("completed", "truncated"):
            raise ProtocolError(f"rollout layer: group {out.prompt_id!r} sample {i} has no reward")
    return out


# -- default implementations ----------------------------------------------------
async def single_turn_agent(ctx: AgentContext) -> dict[str, Any]:
    """Send the prompt's messages once; the reply's text is the answer."""
    reply = await ctx.client.chat(ctx.session_id, ctx.prompt["messages"], ctx.tools, ctx.sampling)
    return {"response": reply["message"].get("content", ""), "finish_reason": reply["finish_reason"]}


async def default_generate(ctx: GenerateContext) -> list[Sample]:
    """Open a session, run the agent, export its trajectories, close it."""
    sid = await ctx.client.create_session(ctx.tools, {"prompt_id": ctx.prompt.get("id")})
    try:
        info = validate_agent_output(await ctx.agent(AgentContext(
            ctx.client, sid, ctx.prompt, ctx.tools, ctx.sampling, ctx.max_turns)))
        samples = await ctx.client.export(sid)
    finally:
        await ctx.client.close(sid)
    if not samples:
        raise ProtocolError(f"agent finished without a single turn for prompt {ctx.prompt.get('id')!r}")
    for s in samples:
        s.metadata.update(info)
    return samples


async def generate_one(ctx: RolloutContext, prompt: Prompt, sample_index: int) -> list[Sample]:
    """One trajectory with its reward(s): what a rollout worker runs for one buffer `Work` item.

    A generation error becomes a `failed` sample (the buffer drops its group); a plug-in that
    breaks its contract (ProtocolError, ConfigError) propagates."""
    gctx = GenerateContext(ctx.client, prompt, ctx.agent, ctx.tools, ctx.sampling, sample_index, ctx.max_turns)
    try:
        samples = validate_generate_output(await ctx.generate(gctx))
    except (ProtocolError, ConfigError):
        raise
    except Exception as exc:  # noqa: BLE001 - a generation error marks the sample failed, buffer drops it
        return [Sample(prompt_ids=[], status="failed", index=sample_index,
                       metadata={"error": f"{type(exc).__name__}: {exc}"})]
    for s in samples:
        s.index = sample_index
        if s.status in ("completed", "truncated"):
            r = ctx.reward(prompt, s)
            s.reward = float(await r) if inspect.isawaitable(r) else float(r)
    return samples


async def default_rollout(ctx: RolloutContext, prompt: Prompt) -> Group:
    """n concurrent trajectories (`generate_one`), each rewarded; the group of one prompt."""
    outs = await asyncio.gather(*(generate_one(ctx, prompt, i) for i in range(ctx.n_samples)))
    samples: list[Sample] = []
    for i, out in enumerate(outs):
        for s in out:
            s.metadata.setdefault("generate_index", i)
            s.index = len(samples)
            samples.append(s)
    return Group(prompt_id=str(prompt.get("id")), samples=samples, prompt_index=int(prompt.get("index", 0)))
