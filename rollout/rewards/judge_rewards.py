"""Built-in judge-scored rewards: a generative judge is prompted, its answer parsed.

Use one as `rollout.reward_fn` with a `[reward_model]` pool; the reward guard hands it the
pool's client as `judge` (rollout/rewards/judge.py). A judge call that fails raises `JudgeUnavailable`
(the sample is dropped, counted with its reason); an answer that is neither yes nor no scores
0 and is counted (`reward_model/verdict_unparsed`), so a judge that rambles is visible.
"""

from __future__ import annotations

import re
from typing import Any

from miles.rollout.rewards.judge import Judge
from miles.rollout.types import Sample

SYSTEM = "You grade answers. Reply with one word: yes or no."
_VERDICT = re.compile(r"\b(yes|no|correct|incorrect|wrong|right)\b", re.IGNORECASE)
_YES = {"yes", "correct", "right"}


def question_of(prompt: dict[str, Any]) -> str:
    """The last user message's text of a prompt (a plain string or text parts)."""
    for m in reversed(prompt.get("messages") or []):
        if isinstance(m, dict) and m.get("role") == "user":
            c = m.get("content", "")
            if isinstance(c, list):
                return " ".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
            return str(c)
    return str(prompt.get("question", ""))


def parse_verdict(reply: str) -> float | None:
    """1.0 for yes, 0.0 for no (the first such word of the reply), None when it says neither."""
    m = _VERDICT.search(reply)
    return None if m is None else float(m.group(1).lower() in _YES)


async def judge_correct(prompt: dict[str, Any], sample: Sample, judge: Judge) -> float:
    """1.0 when the judge says the response answers the question correctly, given the reference
    answer (`prompt["answer"]`); 0.0 when it says no or gives no verdict (counted)."""
    response = str(sample.metadata.get("response", ""))
    user = (f"Question: {question_of(prompt)}\nReference answer: {prompt.get('answer', '')}\n"
            f"Response: {response}\nDoes the response give the reference answer? Answer yes or no.")
    reply = await judge.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])
    verdict = parse_verdict(reply)
    judge.count_verdict("yes" if verdict == 1.0 else "no" if verdict == 0.0 else "unparsed")
    return verdict or 0.0
