"""Two `verifiers` (0.4, `verifiers.v1`) tasksets as their authors would write them (stand-ins
for tasksets from the Environments Hub), which miles runs unchanged through
rollout/envs/verifiers_env.py:

- `SumTaskset` (single-turn): "What is a + b?", rewarded by `@vf.reward correct` (the last
  number of the reply equals a + b).
- `ToolSumTaskset` (multi-turn): "What is a * b + c?" with a `Calculator` toolset whose
  `@vf.tool add` / `mul` the model may call; the same kind of reward on the final reply.

    env_args = {taskset = "miles.examples.verifiers_sums:SumTaskset", taskset_args = {max_operand = 9}}
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable

import verifiers.v1 as vf


def last_number(text: str) -> int | None:
    nums = re.findall(r"-?\d+", text)
    return int(nums[-1]) if nums else None


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        return float(last_number(trace.last_reply) == task.answer)


class SumTasksetConfig(vf.TasksetConfig):
    max_operand: int = 9
    num_tasks: int = 2000
    seed: int = 0


class SumTaskset(vf.Taskset[SumTask, SumTasksetConfig]):
    def load(self) -> Iterable[SumTask]:
        rng = random.Random(self.config.seed)
        for i in range(self.config.num_tasks):
            a, b = rng.randint(0, self.config.max_operand), rng.randint(0, self.config.max_operand)
            yield SumTask(SumData(id=f"sum-{i}", prompt=f"What is {a} + {b}? Reply with the number.",
                                  answer=a + b), self.config.task)


class Calculator(vf.Toolset):
    TOOL_PREFIX = None  # advertise the tools as `add` and `mul`

    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)

    @vf.tool
    async def mul(self, a: int, b: int) -> str:
        """Multiply two integers."""
        return str(a * b)


class ToolSumTask(vf.Task[SumData]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        return float(last_number(trace.last_reply) == task.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


SYSTEM = ("You can call the tools add(a, b) and mul(a, b). To call one, write exactly one line like:\n"
          '<tool_call>{"name": "mul", "arguments": {"a": 6, "b": 7}}</tool_call>\n'
          "You get the result back. When you know the answer, reply with the number only.")


class ToolSumTaskset(vf.Taskset[ToolSumTask, SumTasksetConfig]):
    def load(self) -> Iterable[ToolSumTask]:
        rng = random.Random(self.config.seed)
        m = self.config.max_operand
        for i in range(self.config.num_tasks):
            a, b, c = rng.randint(2, m), rng.randint(2, m), rng.randint(0, m)
            yield ToolSumTask(SumData(id=f"toolsum-{i}", system_prompt=SYSTEM,
                                      prompt=f"What is {a} * {b} + {c}?", answer=a * b + c), self.config.task)


__all__ = ["SumTaskset"]
