"""Multi-turn tool environment: the model answers arithmetic by calling a `calc` tool.

The agent loops: ask the session for a turn; if the reply has tool calls, run
each with the safe evaluator and append the results as `tool` messages; stop at
a reply without tool calls (its text is the answer) or after `max_turns`.
Reward: the last number in the final answer equals the true value.
"""

from __future__ import annotations

import ast
import json
import operator
import random
from dataclasses import dataclass
from typing import Any

from miles.rollout.envs.base import Environment, SeededPrompts
from miles.rollout.layers import AgentContext, Prompt
from miles.rollout.rewards.builtin import last_number_reward

CALC_TOOL = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression with + - * / // % and parentheses.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}

_OPS: dict[type, Any] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                         ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def safe_eval(expr: str) -> float | int:
    """Evaluate plain arithmetic only (no names, calls or powers); ValueError otherwise."""
    if len(expr) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {expr!r}") from exc

    def ev(n: ast.AST) -> float | int:
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, int | float) and not isinstance(n.value, bool):
            return n.value
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub | ast.UAdd):
            v = ev(n.operand)
            return -v if isinstance(n.op, ast.USub) else v
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.left), ev(n.right))
        raise ValueError(f"unsupported syntax {type(n).__name__} in {expr!r}")

    return ev(tree)


def run_tool(call: dict[str, Any]) -> str:
    """The text result of one OpenAI tool call (errors are returned to the model as text)."""
    fn = call.get("function", {})
    if fn.get("name") != "calc":
        return f"error: unknown tool {fn.get('name')!r}"
    args = fn.get("arguments", "{}")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
        value = safe_eval(str(parsed["expr"]))
    except (ValueError, KeyError, TypeError, ZeroDivisionError, json.JSONDecodeError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


async def calculator_agent(ctx: AgentContext) -> dict[str, Any]:
    messages = list(ctx.prompt["messages"])
    reply: dict[str, Any] = {"message": {"content": ""}, "finish_reason": "stop"}
    turns = sampled = 0
    for turns in range(1, ctx.max_turns + 1):  # noqa: B007 - turns is reported below
        reply = await ctx.client.chat(ctx.session_id, messages, ctx.tools, ctx.sampling)
        sampled += int(reply.get("usage", {}).get("completion_tokens", 0))
        msg = reply["message"]
        messages.append(msg)
        if not msg.get("tool_calls") or reply["finish_reason"] not in ("tool_calls", "stop"):
            break
        for call in msg["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": run_tool(call)})
    # sampled_tokens: what the engine sampled over all turns, as the session answered each turn;
    # the tool env checks the trained sample against it (rollout/envs/tool_math.py)
    return {"response": reply["message"].get("content") or "", "turns": turns,
            "finish_reason": reply["finish_reason"], "sampled_tokens": sampled}


@dataclass
class CalculatorPrompts(SeededPrompts):
    env_name = "calculator"
    seed: int = 0
    max_operand: int = 99
    position: int = 0

    def item(self, i: int) -> Prompt:
        rng = random.Random(self.seed * 7_000_003 + i)
        a, b, c = (rng.randint(1, self.max_operand) for _ in range(3))
        expr = f"{a}*{b}+{c}"
        q = f"What is {expr}? Use the calc tool, then answer with the number."
        return {"id": f"calc-{self.seed}-{i}", "index": i, "answer": str(a * b + c),
                "messages": [{"role": "user", "content": q}]}



def make_env(seed: int = 0, max_operand: int = 99) -> Environment:
    return Environment("calculator", CalculatorPrompts(seed, max_operand), last_number_reward,
                       "miles.rollout.envs.calculator:calculator_agent", [CALC_TOOL])
