"""The calculator task for a real chat model: a system prompt that teaches the tool-call format,
multi-turn through the session server, and a token-count audit of every trajectory.

    [rollout]
    env = "miles.rollout.envs.tool_math:make_env"
    env_args = {max_operand = 30}

Prompts are the calculator env's ("What is a*b+c?"); the agent is its `calculator_agent`:
each reply with `<tool_call>{"name": "calc", ...}</tool_call>` (parsed by the json_tags tool
parser) gets the result back as a `tool` message; a reply without one is the answer, scored
by its last number. Chat templates that drop `tools` (SmolLM2's does) never show the model
the tool, hence the system prompt with one worked exchange.

Token-exact sessions: the session store keeps the engine's sampled ids as they are and
tokenizes only the new suffix (the tool result) onto them. The reward checks it on every
trajectory before scoring: the tokens the trainer will train on (loss mask 1) must be
exactly as many as the engine sampled over the turns (the agent sums each turn's
`completion_tokens`). A difference raises `TokenDrift`,
which stops the run (`rollout.reward_errors = "stop"`): a finished run had 0 drift.
"""

from __future__ import annotations

from miles.core.errors import MilesError
from miles.rollout.envs.base import Environment
from miles.rollout.envs.calculator import CALC_TOOL, CalculatorPrompts
from miles.rollout.layers import Prompt
from miles.rollout.rewards.builtin import last_number_reward
from miles.rollout.types import Sample

# One worked exchange in the system prompt: a 135M model copies a demonstrated format far more
# often than it follows a described one (as text: a `tool` message needs a structured call before it).
SYSTEM = ("You can use a calculator tool. To use it, write exactly one line like:\n"
          '<tool_call>{"name": "calc", "arguments": {"expr": "12*34+5"}}</tool_call>\n'
          "You will get the result back. Then reply with the final number only.\n\n"
          "Example:\nuser: What is 7*8+9?\n"
          'assistant: <tool_call>{"name": "calc", "arguments": {"expr": "7*8+9"}}</tool_call>\n'
          "tool: 65\nassistant: 65")


class TokenDrift(MilesError):
    """A trajectory's trained tokens differ from what the engine sampled."""


def drift(sample: Sample) -> int:
    """|trained tokens - sampled tokens| of one trajectory (0 for a token-exact session)."""
    sampled = int(sample.metadata.get("sampled_tokens", -1))
    if sampled < 0:
        raise TokenDrift("the agent reported no sampled_tokens; use miles.rollout.envs.calculator:calculator_agent")
    return abs(sum(sample.loss_mask) - sampled)


def audited_reward(prompt: Prompt, sample: Sample) -> float:
    d = drift(sample)
    if d:
        raise TokenDrift(f"prompt {prompt.get('id')!r}: {sum(sample.loss_mask)} trained tokens against "
                         f"{sample.metadata.get('sampled_tokens')} sampled ({d} drifted)")
    return last_number_reward(prompt, sample)


class ToolMathPrompts(CalculatorPrompts):
    env_name = "tool_math"

    def item(self, i: int) -> Prompt:
        p = super().item(i)
        return {**p, "id": p["id"].replace("calc-", "toolmath-", 1),
                "messages": [{"role": "system", "content": SYSTEM}, *p["messages"]]}


def make_env(seed: int = 0, max_operand: int = 30) -> Environment:
    return Environment("tool_math", ToolMathPrompts(seed, max_operand), audited_reward,
                       "miles.rollout.envs.calculator:calculator_agent", [CALC_TOOL])
