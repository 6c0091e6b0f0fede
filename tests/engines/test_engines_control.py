"""Engine control: atomic weight update under concurrent generation, pause modes, abort, checksums."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.core.errors import EngineError
from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.torch_engine import TorchEngine
from miles.models.hf_io import checksums, hf_state_dict

from .conftest import tiny_model


def req(ids: list[int], n: int, seed: int = 0, key: str | None = None) -> GenerateRequest:
    return GenerateRequest(
        input_ids=ids, session_key=key, sampling=SamplingParams(temperature=0.0, max_new_tokens=n, seed=seed)
    )


async def stage_in_buckets(eng: TorchEngine, version: int, weights: dict[str, torch.Tensor]) -> None:
    names = sorted(weights)
    for i in range(0, len(names), 5):
        await eng.stage(version, [(n, weights[n]) for n in names[i : i + 5]])


async def test_commit_is_atomic_under_concurrent_generation(dense_model) -> None:
    new_model = tiny_model("qwen3", seed=11)
    new_w = hf_state_dict(new_model)
    eng = TorchEngine(dense_model, EngineConfig(max_batch_size=4, max_seq_len=256))
    try:
        ref_old = await eng.generate(req([1, 2, 3], 6))
        ref_new_eng = TorchEngine(new_model, EngineConfig(max_seq_len=256))
        ref_new = await ref_new_eng.generate(req([1, 2, 3], 6))
        await ref_new_eng.close()
        assert ref_old.output_ids != ref_new.output_ids

        await stage_in_buckets(eng, 1, new_w)
        long = asyncio.create_task(eng.generate(req([9, 8, 7], 60)))
        before = await asyncio.gather(*(eng.generate(req([1, 2, 3], 6)) for _ in range(3)))
        await eng.commit(1)  # between the short requests, during the long one
        after = await asyncio.gather(*(eng.generate(req([1, 2, 3], 6)) for _ in range(3)))
        for r in before:
            assert r.versions == [0] * 6 and r.output_ids == ref_old.output_ids
        for r in after:
            assert r.versions == [1] * 6 and r.output_ids == ref_new.output_ids
        lr = await long
        # in flight across the commit: continues on the new weights, versions record the switch
        assert lr.versions == sorted(lr.versions) and lr.versions[0] == 0 and lr.versions[-1] == 1
        assert eng.checksums() == checksums(new_model) and eng.health().version == 1
    finally:
        await eng.close()


async def test_incomplete_or_bad_stage_is_refused(engine: TorchEngine) -> None:
    w = engine.state_dict_hf()
    name = next(iter(w))
    with pytest.raises(EngineError, match="unknown tensor 'nope'"):
        await engine.stage(1, {"nope": torch.zeros(1)})
    with pytest.raises(EngineError, match="has shape"):
        await engine.stage(1, {name: torch.zeros(1)})
    await engine.stage(1, {name: w[name] + 1})
    with pytest.raises(EngineError, match="tensors not staged"):
        await engine.commit(1)
    with pytest.raises(EngineError, match="older version than the staged 1"):
        await engine.stage(0, {name: w[name]})  # a late bucket of an abandoned sync
    await engine.stage(2, {name: w[name]})  # a newer version: v1, never completed, is dropped
    with pytest.raises(EngineError, match="nothing staged for it"):
        await engine.commit(1)
    await engine.stage(2, w)
    await engine.commit(2)
    assert engine.version == 2


@pytest.mark.parametrize("mode", ["abort", "retract"])
async def test_pause_returns_partial_work(engine: TorchEngine, mode: str) -> None:
    task = asyncio.create_task(engine.generate(req([1, 2, 3], 200, key="s")))
    queued = asyncio.create_task(engine.generate(req([4], 5)))
    while engine.stats()["generated_tokens"] < 5:
        await asyncio.sleep(0.001)
    out = await engine.pause(mode)
    res = await task
    assert res.finish_reason == "abort" and 0 < len(res.output_ids) < 200
    assert res.retracted == (mode == "retract") and res in out
    assert (await queued).finish_reason in ("abort", "length")
    await engine.resume()
    again = await engine.generate(req([1, 2, 3, *res.output_ids], 3, key="s"))
    assert again.cached_tokens == 2 + len(res.output_ids)


async def test_pause_in_place_holds_and_resume_continues(engine: TorchEngine) -> None:
    alone = await engine.generate(req([5, 5], 30))
    task = asyncio.create_task(engine.generate(req([5, 5], 30)))
    while engine.stats()["generated_tokens"] < 35:
        await asyncio.sleep(0.001)
    assert await engine.pause("in_place") == []
    n = engine.stats()["generated_tokens"]
    await asyncio.sleep(0.05)  # fixed on purpose: a window in which no token may be generated
    assert engine.stats()["generated_tokens"] == n and not task.done()
    await engine.resume()
    assert (await task).output_ids == alone.output_ids


async def test_abort_one_request(engine: TorchEngine) -> None:
    r = req([1], 500)
    task = asyncio.create_task(engine.generate(r))
    while engine.stats()["generated_tokens"] < 3:
        await asyncio.sleep(0.001)
    assert await engine.abort(r.request_id)
    res = await task
    assert res.finish_reason == "abort" and len(res.output_ids) < 500
    assert not await engine.abort(r.request_id)
