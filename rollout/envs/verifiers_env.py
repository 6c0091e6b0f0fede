"""A `verifiers` (0.4, `verifiers.v1`) environment's taskset, unchanged: its tasks for prompts,
its tools for multi-turn, its `@vf.reward` functions (and plugged rewards) for the reward.

    [rollout]
    env = "miles.rollout.envs.verifiers_env:make_env"
    env_args = {taskset = "my_taskset"}                       # an installed taskset package (hub id)
    # or    = {taskset = "my_pkg.tasks:MyTaskset", taskset_args = {...}}   # a Taskset class

miles plays the harness: verifiers' own harnesses launch agent programs in sandboxes and reach
the model through an interception proxy, which a trainer does not need; here every turn goes
through miles' session store, so the trained ids and logprobs are the engine's own. A turn
whose reply calls tools runs them in-process on the task's (and taskset's) `vf.Toolset`s (their
`@vf.tool` methods, named `<prefix>_<name>` as verifiers advertises them) and appends the
results as `tool` messages; a reply without tool calls ends the trajectory (or
`rollout.max_turns` does). The finished conversation is scored by the task itself: a
`vf.Trace` of its messages (the sampled turns marked, with their token ids and logprobs) goes
to `task.score(trace)` offline (no runtime: rewards that need one are skipped, as verifiers
does), and the reward is `trace.reward`, the weighted sum. Each trajectory passes the
token-drift audit first (rollout/envs/hub_common.py). Prompt i is task i mod `size` of the
taskset's first `size` tasks (`shuffle`: in a seeded order). Needs `pip install 'miles[verifiers]'`.
"""

from __future__ import annotations

import inspect
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

from miles.core.errors import ConfigError
from miles.core.hooks import resolve_import_path
from miles.rollout.envs.base import Environment, SeededPrompts
from miles.rollout.envs.hub_common import TurnCount, audited, chat_turn, require
from miles.rollout.layers import AgentContext, Prompt
from miles.rollout.types import Sample

EXTRA = "verifiers"


def _vf() -> Any:
    return require("verifiers.v1", EXTRA, "the verifiers env")


def load_taskset(taskset: str, taskset_args: dict[str, Any]) -> Any:
    """verifiers' own loading: an installed taskset id, or a `module:Class` Taskset subclass."""
    vf = _vf()
    if ":" in taskset:
        from verifiers.v1.utils.generic import concrete_type

        cls = resolve_import_path(taskset, "rollout.env_args.taskset")
        if not (isinstance(cls, type) and issubclass(cls, vf.Taskset)):
            raise ConfigError(f"verifiers env: {taskset!r} is not a verifiers.v1.Taskset subclass")
        cfg_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        return cls(cfg_cls.model_validate({"id": taskset.split(":")[0], **taskset_args}))
    try:
        cfg_cls = vf.taskset_config_type(taskset)
        return vf.load_taskset(cfg_cls.model_validate({"id": taskset, **taskset_args}))
    except (ModuleNotFoundError, AttributeError, TypeError, ValueError) as exc:
        raise ConfigError(f"verifiers env: taskset {taskset!r}: {exc}") from exc


def _schema(fn: Any) -> dict[str, Any]:
    """The JSON schema of a tool method's arguments (its signature, as MCP would publish it)."""
    from pydantic import create_model

    fields: dict[str, Any] = {}
    for name, p in inspect.signature(fn).parameters.items():
        ann = p.annotation if p.annotation is not inspect.Parameter.empty else Any
        fields[name] = (ann, ... if p.default is inspect.Parameter.empty else p.default)
    schema = create_model(f"{fn.__name__}_args", **fields).model_json_schema()
    schema.pop("title", None)
    return schema


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@dataclass
class ToolBox:
    """A taskset's tools as OpenAI function specs, and their methods to call in-process."""

    specs: list[dict[str, Any]] = field(default_factory=list)
    fns: dict[str, Any] = field(default_factory=dict)

    def add(self, toolset: Any) -> None:
        from verifiers.v1.utils.decorators import discover_decorated

        prefix = type(toolset).TOOL_PREFIX
        prefix = _snake(type(toolset).__name__) if prefix == "" else prefix
        for fn in discover_decorated(toolset, "tool"):
            base = getattr(fn, "tool_name", None) or fn.__name__
            name = f"{prefix}_{base}" if prefix else base
            self.fns[name] = fn
            self.specs.append({"type": "function", "function": {
                "name": name, "description": (fn.__doc__ or "").strip(), "parameters": _schema(fn)}})

    async def call(self, call: dict[str, Any]) -> str:
        """One OpenAI tool call's text result (errors go back to the model as text, as MCP does)."""
        fn_spec = call.get("function", {})
        fn = self.fns.get(fn_spec.get("name", ""))
        if fn is None:
            return f"error: unknown tool {fn_spec.get('name')!r}"
        try:
            args = fn_spec.get("arguments") or "{}"
            out = fn(**(json.loads(args) if isinstance(args, str) else args))
            out = await out if inspect.isawaitable(out) else out
        except Exception as exc:  # noqa: BLE001 - a failing tool is the model's observation
            return f"error: {type(exc).__name__}: {exc}"
        return out if isinstance(out, str) else json.dumps(out, default=str)


def _message_dict(m: Any) -> dict[str, Any]:
    d = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
    if not isinstance(d.get("content", ""), str):  # content parts: the text ones, joined
        d["content"] = "".join(p.get("text", "") for p in d["content"] if isinstance(p, dict))
    return d


@dataclass
class VerifiersPrompts(SeededPrompts):
    env_name = "verifiers"

    taskset: str = ""
    taskset_args: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    size: int = 1000
    shuffle: bool = False
    position: int = 0

    def __post_init__(self) -> None:
        self.ts = load_taskset(self.taskset, self.taskset_args)
        self.tasks = list(self.ts.take(self.size))
        if not self.tasks:
            raise ConfigError(f"verifiers env: taskset {self.taskset!r} yielded no task")
        self.order = list(range(len(self.tasks)))
        if self.shuffle:
            random.Random(self.seed).shuffle(self.order)
        self.tools = ToolBox()
        for ts in type(self.ts).toolsets(self.ts.config):
            self.tools.add(ts)
        task_cls = type(self.tasks[0])
        for ts in task_cls.toolsets(self.tasks[0].config):
            self.tools.add(ts)

    def task(self, i: int) -> Any:
        return self.tasks[self.order[i % len(self.tasks)]]

    def item(self, i: int) -> Prompt:
        data = self.task(i).data
        msgs: list[dict[str, Any]] = []
        if data.system_prompt:
            msgs.append({"role": "system", "content": data.system_prompt})
        if isinstance(data.prompt, str):
            msgs.append({"role": "user", "content": data.prompt})
        else:
            msgs.extend(_message_dict(m) for m in data.prompt or [])
        return {"id": f"vf-{self.taskset}-{self.seed}-{i % len(self.tasks)}", "index": i, "vf_index": i,
                "vf_taskset": {"taskset": self.taskset, "taskset_args": self.taskset_args}, "messages": msgs}


async def verifiers_agent(ctx: AgentContext) -> dict[str, Any]:
    """The chat loop of a verifiers harness, through the session: tools until a plain reply."""
    box = toolbox(ctx.prompt["vf_taskset"])
    messages = list(ctx.prompt["messages"])
    count = TurnCount()
    reply: dict[str, Any] = {"message": {"content": ""}, "finish_reason": "stop"}
    for _ in range(ctx.max_turns):
        reply = await chat_turn(ctx, messages, count)
        msg = reply["message"]
        messages.append(msg)  # as the session stored it: the next turn must match it
        if not msg.get("tool_calls") or reply["finish_reason"] not in ("tool_calls", "stop"):
            break
        for call in msg["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": await box.call(call)})
    return {"response": reply["message"].get("content") or "", "finish_reason": reply["finish_reason"],
            "turns": count.turns, "sampled_tokens": count.sampled, "vf_messages": messages}


# the tools of each taskset this process loaded: the agent is an import path, not a closure
# over its env, so it finds them by the taskset the prompt names (loading it if need be)
TOOLBOXES: dict[str, ToolBox] = {}


def toolbox(spec: dict[str, Any]) -> ToolBox:
    key = json.dumps(spec, sort_keys=True)
    if key not in TOOLBOXES:
        TOOLBOXES[key] = VerifiersPrompts(spec["taskset"], spec["taskset_args"], size=1).tools
    return TOOLBOXES[key]


def to_trace(task: Any, messages: list[dict[str, Any]], sample: Sample | None = None) -> Any:
    """A verifiers Trace of the conversation: one node per message, the assistant ones sampled."""
    vf = _vf()
    from pydantic import TypeAdapter

    adapter = TypeAdapter(vf.Message)
    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=vf.AgentInfo(config=vf.AgentConfig(), name="miles"))
    for i, m in enumerate(messages):
        d = {k: v for k, v in m.items() if v is not None}
        if d.get("tool_calls"):  # OpenAI {function: {name, arguments}} -> verifiers' flat ToolCall
            d["tool_calls"] = [{"id": c.get("id", ""), "name": c.get("function", {}).get("name", ""),
                                "arguments": c.get("function", {}).get("arguments", "{}")} for c in d["tool_calls"]]
        d = {k: v for k, v in d.items() if k in ("role", "content", "tool_calls", "tool_call_id", "name",
                                                  "reasoning_content")}
        trace.nodes.append(vf.MessageNode(message=adapter.validate_python(d), parent=i - 1 if i else None,
                                          sampled=d["role"] == "assistant"))
    trace.is_completed = trace.ok = True
    if sample is not None:
        trace.info["miles"] = {"prompt_tokens": len(sample.prompt_ids), "response_tokens": len(sample.response_ids),
                               "sampled_tokens": sample.num_sampled}
    return trace


def make_reward(prompts: VerifiersPrompts) -> Any:
    async def task_score(prompt: Prompt, sample: Sample) -> float:
        task = prompts.task(int(prompt["vf_index"]))
        msgs = sample.metadata.get("vf_messages")
        if not msgs:  # an answer that came without the agent (the evaluator's greedy one)
            msgs = [*prompt["messages"], {"role": "assistant", "content": str(sample.metadata.get("response", ""))}]
        trace = to_trace(task, msgs, sample)
        await task.score(trace)
        sample.metadata["vf_rewards"] = {k: (None if r is None else r.score) for k, r in trace.rewards.items()}
        sample.metadata.pop("vf_messages", None)  # scored: the trainer needs only the ids
        return float(trace.reward)

    return audited(task_score)


def make_env(taskset: str = "", taskset_args: dict[str, Any] | None = None, seed: int = 0, size: int = 1000,
             shuffle: bool = False) -> Environment:
    if not taskset:
        raise ConfigError("verifiers env: env_args.taskset is required (an installed taskset id, or "
                          "'module:TasksetClass')")
    prompts = VerifiersPrompts(taskset, dict(taskset_args or {}), seed, size, shuffle)
    TOOLBOXES[json.dumps({"taskset": taskset, "taskset_args": prompts.taskset_args}, sort_keys=True)] = prompts.tools
    return Environment(f"verifiers:{taskset}", prompts, make_reward(prompts),
                       "miles.rollout.envs.verifiers_env:verifiers_agent", prompts.tools.specs or None)
