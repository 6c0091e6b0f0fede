"""The diffusion engine behind the engine contract: it samples what the sampler defines,
swaps staged weights in atomically between two denoising steps (each step records its
version), holds trajectories while paused, and refuses what does not fit."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.core.errors import EngineError
from miles.diffusion.engine import DenoiseRequest, DiffusionEngine
from miles.diffusion.sampler import sample_sde
from miles.engines.base import GenerateRequest

from .helpers import SCHED, tiny_net

pytestmark = pytest.mark.timeout(60)


async def until_running(eng: DiffusionEngine, n: int, timeout_s: float = 20.0) -> None:
    """Until `n` trajectories are in the engine's running batch (not a fixed sleep: CI is loaded)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while eng.health().running < n:
        assert asyncio.get_running_loop().time() < deadline, eng.health()
        await asyncio.sleep(0.005)


async def test_engine_samples_the_sampler_process() -> None:
    net = tiny_net()
    eng = DiffusionEngine(tiny_net(), SCHED, max_batch=3)  # 5 requests: two batches
    try:
        reqs = [DenoiseRequest(c, s) for c, s in zip([0, 1, 2, 3, 0], [7, 8, 9, 10, 11], strict=True)]
        res = await eng.denoise(reqs)
        ref = sample_sde(net, torch.tensor([0, 1, 2, 3, 0]), [7, 8, 9, 10, 11], (3, 16, 16), SCHED)
        for i, r in enumerate(res):
            assert r.request_id == reqs[i].request_id and not r.aborted
            torch.testing.assert_close(torch.from_numpy(r.latents), ref.latents[i], atol=1e-5, rtol=0)
            torch.testing.assert_close(torch.from_numpy(r.logprobs), ref.logprobs[i], atol=1e-5, rtol=0)
            assert r.versions.tolist() == [0] * SCHED.steps
        assert eng.stats()["images"] == 5
        with pytest.raises(EngineError, match="denoise"):
            await eng.generate(GenerateRequest([1, 2]))
    finally:
        await eng.close()


async def test_commit_between_steps_while_paused_in_place() -> None:
    eng = DiffusionEngine(tiny_net(seed=3), SCHED)
    new = tiny_net(seed=9)
    try:
        await eng.pause("in_place")
        task = asyncio.ensure_future(eng.denoise([DenoiseRequest(3, 1), DenoiseRequest(3, 2)]))
        await until_running(eng, 2)  # taken into a batch, held at the pause
        assert not task.done() and eng.health().paused
        staged = await eng.stage(1, [(n, p.detach()) for n, p in new.named_parameters()])
        assert staged == len(list(new.parameters()))
        with pytest.raises(EngineError, match="nothing staged"):
            await eng.commit(2)
        await eng.commit(1)
        assert eng.checksums() == DiffusionEngine(new, SCHED).checksums()
        with pytest.raises(EngineError, match="already serves"):
            await eng.stage(1, {})
        await eng.resume()
        res = await asyncio.wait_for(task, 30)
        assert [r.versions.tolist() for r in res] == [[1] * SCHED.steps] * 2
    finally:
        await eng.close()


async def test_pause_abort_finishes_running_trajectories_as_aborted() -> None:
    eng = DiffusionEngine(tiny_net(), SCHED)
    try:
        await eng.pause("in_place")
        task = asyncio.ensure_future(eng.denoise([DenoiseRequest(0, 5)]))
        await until_running(eng, 1)
        await eng.pause("abort")
        (r,) = await asyncio.wait_for(task, 10)
        assert r.aborted and len(r.logprobs) < SCHED.steps
        await eng.resume()
        (r2,) = await eng.denoise([DenoiseRequest(0, 5)])
        assert not r2.aborted and len(r2.logprobs) == SCHED.steps
    finally:
        await eng.close()
