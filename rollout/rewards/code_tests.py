"""The code-test reward: run the model's program against the label's tests in the sandbox.

Labels take one of two forms:
- a string of Python test code (e.g. `assert add(1, 2) == 3`), appended to the program and
  run once: reward 1.0 when it exits 0;
- a list of `{"input": str, "output": str}` cases: the program runs once per case with the
  input on stdin; the reward is the fraction whose stdout matches (trailing space ignored).
The program is the last ```python fenced block in the response, else the whole response.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any, Literal

from miles.rollout.rewards.rules import response_text
from miles.rollout.rewards.sandbox import SandboxLimits, run_python
from miles.rollout.types import Sample

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last fenced code block's body, else the text itself."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def _same_output(got: str, want: str) -> bool:
    lines = lambda s: [ln.rstrip() for ln in s.strip().splitlines()]  # noqa: E731
    return lines(got) == lines(want)


@dataclass
class CodeTestsReward:
    """Fraction of the label's tests the response's program passes, run in `rollout.rewards.sandbox`."""

    weight: float = 1.0
    timeout_s: float = 5.0  # per run (one per stdin case), wall clock
    memory_mib: int = 512  # address-space limit per run
    network: Literal["deny", "allow"] = "deny"  # deny needs `unshare -rn`; see rollout/rewards/sandbox.py
    max_concurrent: int = 4  # sandboxed runs at once in this process
    needs_label = True

    def __post_init__(self) -> None:
        self.limits = SandboxLimits(self.timeout_s, self.memory_mib, network=self.network)
        self._sem: asyncio.Semaphore | None = None

    async def _run(self, code: str, stdin: str = "") -> Any:
        if self._sem is None:  # created lazily: it must belong to the running loop
            self._sem = asyncio.Semaphore(max(1, self.max_concurrent))
        async with self._sem:
            return await run_python(code, stdin, self.limits)

    async def score(self, program: str, label: Any) -> float:
        if isinstance(label, str):
            return float((await self._run(program + "\n\n" + label + "\n")).ok)
        results = await asyncio.gather(*(self._run(program, str(c["input"])) for c in label))
        passed = sum(r.ok and _same_output(r.stdout, str(c["output"])) for r, c in zip(results, label, strict=True))
        return passed / len(label)

    def __call__(self, prompt: dict[str, Any], sample: Sample) -> Any:
        return self.score(extract_code(response_text(sample)), prompt["label"])

    def check_label(self, label: Any) -> str | None:
        if isinstance(label, str):
            if not label.strip():
                return "code_tests: empty test code"
            try:
                compile(label, "<label>", "exec")
            except SyntaxError as exc:
                return f"code_tests: label test code does not compile: {exc.msg} (line {exc.lineno})"
            return None
        if not isinstance(label, list) or not label:
            return "code_tests: label must be Python test code or a non-empty list of {input, output} cases"
        for i, c in enumerate(label):
            if not isinstance(c, dict) or "input" not in c or "output" not in c:
                return f"code_tests: case {i} must be an object with 'input' and 'output'"
        return None
