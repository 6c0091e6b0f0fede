"""Eval answers that outlive a weight update: a request the engine hands back at a pause is continued.

In `eval.mode = "shared"` the evaluation runs on the rollout engines while the trainer goes on
stepping, so a weight push can land in the middle of an answer. The torch engine pauses in
place and the answer simply continues; SGLang (and any engine in `sync.pause_mode = "retract"`
or `"abort"`) hands the request back instead. Scoring that partial answer would grade a
truncated text: on an H100 in session 18, SGLang's mid-run evals read 8-11 % greedy accuracy
at a mean of ~125 tokens while the same run's final eval, with no push in flight, read 30 %
at ~295 tokens. The rollout's own requests were never affected: they are continued the same
way (rollout/routing/requests.py).

Here a retracted answer is resubmitted as prompt + what it had so far with the rest of its
token budget, and an aborted one (its partial output dropped) is asked again from the start.
An answer that spans a push was produced by two weight versions, as under an in-place pause.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from miles.core.errors import MilesError
from miles.core.generation import GenerateFailed, GenerateResult

Reply = GenerateResult | GenerateFailed
Ask = Callable[[list[list[int]], list[dict[str, Any]]], Awaitable[list[Reply]]]

# A bound on how often one answer may be interrupted: a push every few seconds against answers of
# tens of seconds gives a handful; this many means the engine hands everything back at once.
MAX_INTERRUPTIONS = 64


class EvalInterrupted(MilesError):
    """An eval answer was handed back by its engine more often than `MAX_INTERRUPTIONS`."""


def _merge(acc: GenerateResult | None, r: GenerateResult) -> GenerateResult:
    """`r` continued `acc`: one answer with both parts' tokens, counted from the first prompt."""
    if acc is None:
        return r
    return replace(r, output_ids=acc.output_ids + r.output_ids, logprobs=acc.logprobs + r.logprobs,
                   versions=acc.versions + r.versions, prompt_tokens=acc.prompt_tokens)


async def generate_through_pauses(ask: Ask, ids: list[int], samplings: list[dict[str, Any]]) -> tuple[
        list[Reply], int]:
    """Every sampling's whole answer to `ids`, continued across pauses; and how many requests were
    resubmitted. A `GenerateFailed` is returned as it came (the caller reports it)."""
    budgets = [int(s["max_new_tokens"]) for s in samplings]
    done: list[Reply | None] = [None] * len(samplings)
    partial: list[GenerateResult | None] = [None] * len(samplings)
    todo = list(range(len(samplings)))
    resubmits = 0
    for _ in range(MAX_INTERRUPTIONS + 1):
        prompts, params = [], []
        for i in todo:
            had = partial[i]
            kept: list[int] = list(had.output_ids) if had is not None else []
            prompts.append(ids + kept)
            params.append({**samplings[i], "max_new_tokens": budgets[i] - len(kept)})
        answers = await ask(prompts, params)
        again: list[int] = []
        for i, r in zip(todo, answers, strict=True):
            if isinstance(r, GenerateFailed):
                done[i] = r
                continue
            if r.retracted:
                so_far = partial[i] = _merge(partial[i], r)
                if len(so_far.output_ids) >= budgets[i]:  # handed back exactly at its budget
                    done[i] = replace(so_far, finish_reason="length", retracted=False)
                    continue
                again.append(i)
            elif r.finish_reason == "abort":
                partial[i] = None  # aborted: its tokens were not kept, so it starts over
                again.append(i)
            else:
                done[i] = _merge(partial[i], r)
        resubmits += len(again)
        todo = again
        if not todo:
            return [d for d in done if d is not None], resubmits
    raise EvalInterrupted(f"eval answer handed back by its engine {MAX_INTERRUPTIONS} times in a row (a pause at every "
                          "push, and pushes faster than one answer): the engine returns every request at once")
