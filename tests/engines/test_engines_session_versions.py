"""Saved session KV carries the weight version that wrote it; by default a turn under newer
weights recomputes it instead of reusing it (engine.session_kv_reuse, issue 36)."""

from __future__ import annotations

import pytest

from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.torch_engine import TorchEngine
from miles.models.hf_io import hf_state_dict

from .conftest import tiny_model

pytestmark = pytest.mark.timeout(120)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def req(ids: list[int], key: str | None = None) -> GenerateRequest:
    return GenerateRequest(input_ids=ids, session_key=key, sampling=SamplingParams(temperature=0.0, max_new_tokens=6))


async def _update(eng: TorchEngine, version: int) -> None:
    new = hf_state_dict(tiny_model("qwen3", seed=1))
    await eng.stage(version, list(new.items()))
    await eng.commit(version)


@pytest.mark.parametrize("reuse", ["same_version", "any"])
async def test_session_kv_across_a_weight_update(reuse: str) -> None:
    eng = TorchEngine(tiny_model("qwen3", seed=0), EngineConfig(max_seq_len=256, session_kv_reuse=reuse))
    fresh = TorchEngine(tiny_model("qwen3", seed=1), EngineConfig(max_seq_len=256))  # the new weights, no history
    try:
        t1 = await eng.generate(req(PROMPT, "s"))
        await _update(eng, 1)
        turn2 = PROMPT + t1.output_ids + [7, 8]
        t2 = await eng.generate(req(turn2, "s"))
        ref = await fresh.generate(req(turn2))
        if reuse == "same_version":
            assert t2.cached_tokens == 0 and eng.stats()["stale_session_kv"] == 1
            assert t2.output_ids == ref.output_ids
            assert t2.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        else:  # the old KV is reused: the turn rests on keys and values of the old weights
            assert t2.cached_tokens == len(PROMPT) + len(t1.output_ids)
            assert eng.stats()["stale_session_kv"] == 0
        # KV written under the serving version is reused either way
        t3 = await eng.generate(req(turn2 + t2.output_ids + [9], "s"))
        assert t3.cached_tokens == len(turn2) + len(t2.output_ids)
    finally:
        await eng.close()
        await fresh.close()
