"""Eval answers continue across an engine's pause (actors/eval_requests.py): a retracted answer is
resubmitted with what it had, an aborted one asked again, so no eval scores a truncated answer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from miles.actors.engine import sampling_from_wire
from miles.actors.eval_requests import Reply, generate_through_pauses
from miles.engines.base import GenerateRequest, GenerateResult
from miles.engines.torch_engine import TorchEngine

pytestmark = pytest.mark.timeout(120)

BUDGET = 200
SAMPLING = [{"temperature": 0.0, "max_new_tokens": BUDGET}, {"temperature": 1.0, "max_new_tokens": BUDGET, "seed": 3}]


def asker(engine: TorchEngine):
    async def ask(prompts: list[list[int]], params: list[dict[str, Any]]) -> list[Reply]:
        # what the engine actor's GenerateMany does with one message: all at once, results in order
        rs = await asyncio.gather(*(engine.generate(GenerateRequest(p, sampling_from_wire(s)))
                                    for p, s in zip(prompts, params, strict=True)))
        return list(rs)
    return ask


@pytest.mark.parametrize("mode", ["retract", "abort"])
async def test_an_answer_handed_back_at_a_pause_is_completed(engine: TorchEngine, mode: str) -> None:
    async def pause_twice() -> int:
        handed_back = 0
        for mark in (5, 60):
            while engine.stats()["generated_tokens"] < start + mark:
                await asyncio.sleep(0.001)
            handed_back += len(await engine.pause(mode))
            await engine.resume()
        return handed_back

    start = engine.stats()["generated_tokens"]
    (answers, resubmits), handed_back = await asyncio.gather(
        generate_through_pauses(asker(engine), [1, 2, 3], SAMPLING), pause_twice())
    assert handed_back >= 1 and resubmits >= 1  # the pauses caught the answers in flight
    for r in answers:
        # whole answers: the budget's worth of tokens (the tiny model meets no stop id), none cut at a pause
        assert isinstance(r, GenerateResult)
        assert r.finish_reason == "length" and not r.retracted, r.finish_reason
        assert len(r.output_ids) == len(r.logprobs) == len(r.versions) == BUDGET


async def test_an_answer_with_no_pause_is_asked_once(engine: TorchEngine) -> None:
    calls = []
    ask = asker(engine)

    async def counted(prompts: list[list[int]], params: list[dict[str, Any]]) -> list[dict[str, Any]]:
        calls.append(len(prompts))
        return await ask(prompts, params)

    answers, resubmits = await generate_through_pauses(counted, [4, 5], SAMPLING)
    assert resubmits == 0 and calls == [2]
    assert [len(r.output_ids) for r in answers if isinstance(r, GenerateResult)] == [BUDGET, BUDGET]
