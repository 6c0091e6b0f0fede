"""THE TESTS' POLICY: a deterministic scripted stand-in for a language model.

It reads the prompt ids through the real tokenizer and writes a reply as token
ids, like an engine would; it is the input to the code under test (session
store, rollout layers, envs), not a replacement for any of it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from miles.rollout.tito.client import EngineOutput
from miles.rollout.tokens.tokenizer import Tokenizer


class ScriptedPolicy:
    def __init__(self, tok: Tokenizer, wrong_every: int = 0, fail_on: str | None = None) -> None:
        self.tok = tok
        self.calls = 0
        self.wrong_every = wrong_every  # every k-th arithmetic answer is off by one (0 = never)
        self.fail_on = fail_on  # raise when the prompt contains this text
        self.end = tok.token_to_id("<|im_end|>")

    def _reply(self, text: str) -> str:
        last = text.rsplit("<|im_start|>", 2)[-2]  # the message just before the generation prompt
        if last.startswith("tool\n"):
            return "The answer is " + last[5:].split("<|im_end|>")[0]
        m = re.search(r"What is ([\d*+]+)\?", last)
        if m:
            call = json.dumps({"name": "calc", "arguments": {"expr": m.group(1)}}, separators=(",", ":"))
            return f"<tool_call>{call}</tool_call>"
        m = re.search(r"(\d+)([+\-*])(\d+)=", last)
        if m:
            a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
            ans = a + b if op == "+" else a - b if op == "-" else a * b
            if self.wrong_every and self.calls % self.wrong_every == 0:
                ans += 1
            return str(ans)
        return "ok"

    async def __call__(self, prompt_ids: list[int], sampling: dict[str, Any]) -> EngineOutput:
        self.calls += 1
        text = self.tok.decode(prompt_ids)
        if self.fail_on and self.fail_on in text:
            raise RuntimeError("engine failed (scripted)")
        ids = self.tok.encode(self._reply(text)) + [self.end]
        return EngineOutput(ids, [-0.01 * (i + 1) for i in range(len(ids))], "stop", version=sampling.get("v", 0))
