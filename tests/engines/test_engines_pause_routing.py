"""Pause (abort / retract) with routing replay on: every returned request carries one routing row
per token, whether it was queued, mid-generation, or finished but not yet flushed."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from miles.core.schema.engine import EngineConfig
from miles.engines import torch_engine
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.torch_engine import TorchEngine


def routed_req(ids: list[int], n: int) -> GenerateRequest:
    return GenerateRequest(
        input_ids=ids, return_routed_experts=True, sampling=SamplingParams(temperature=0.0, max_new_tokens=n)
    )


@pytest.mark.parametrize("mode", ["abort", "retract"])
async def test_pause_covers_every_token_with_routing(moe_model, monkeypatch, mode: str) -> None:
    # one step per worker hop: the pause lands right after the prefill step, when the
    # 1-token request has sampled its token but not fed it (its flush step is still due)
    monkeypatch.setattr(torch_engine, "_MAX_STEPS_PER_HOP", 1)
    spec = moe_model.spec
    eng = TorchEngine(moe_model, EngineConfig(max_batch_size=2, max_seq_len=128))
    try:
        done_early = asyncio.create_task(eng.generate(routed_req([3, 4, 5], 1)))
        long = asyncio.create_task(eng.generate(routed_req([6, 7], 60)))
        queued = asyncio.create_task(eng.generate(routed_req([8, 9, 10, 11], 5)))  # no free row
        while eng.stats()["generated_tokens"] < 1:
            await asyncio.sleep(0)
        out = await eng.pause(mode)
        results = [await done_early, await long, await queued]
        assert len(out) == 3
        for prompt_len, res in zip((3, 2, 4), results, strict=True):
            re = res.routed_experts
            assert re is not None and re.dtype == np.uint8
            fed = 0 if res is results[2] else prompt_len + len(res.output_ids)
            assert re.shape == (fed, spec.num_moe_layers, spec.num_experts_per_tok), res
        assert results[0].finish_reason == "length" and len(results[0].output_ids) == 1
        assert results[2].output_ids == [] and results[2].finish_reason == "abort"
        assert results[2].retracted == (mode == "retract")
    finally:
        await eng.close()
