"""engine.compile_decode: the torch.compile'd decode forward, captured as CUDA graphs (dynamic
shapes, so several batch and key-length buckets share one compile), gives the tokens and
logprobs of the uncompiled graphs, and for a MoE model the same routing (its experts run densely
under the compile's trace, as under a capture). GPU only (the compile without capture on the CPU:
test_engines_compile_cpu.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.torch_engine import TorchEngine

from .conftest import tiny_model

pytestmark = pytest.mark.timeout(240)


async def _generate(model, compiled: bool, routed: bool = False):
    cfg = EngineConfig(device="cuda", max_batch_size=8, max_seq_len=300, kv_budget_tokens=0, compile_decode=compiled)
    eng = TorchEngine(model, cfg)
    # 2 then 5 rows (buckets 2 and 8), keys past 256 (buckets 256 and 300): one compile serves all
    prompts = [[1, 2, 3], [4] * 17, [5, 6], [7, 8, 9, 10, 11], list(range(40))]
    reqs = [GenerateRequest(input_ids=p, return_routed_experts=routed,
                            sampling=SamplingParams(temperature=1.0, seed=i, max_new_tokens=n))
            for i, (p, n) in enumerate(zip(prompts, (4, 260, 3, 4, 6), strict=True))]
    try:
        first = [asyncio.create_task(eng.generate(r)) for r in reqs[:2]]
        while eng.stats()["generated_tokens"] < 4:
            await asyncio.sleep(0)
        rest = [asyncio.create_task(eng.generate(r)) for r in reqs[2:]]
        return await asyncio.gather(*first, *rest)
    finally:
        graphs = eng.stepper.graphs
        assert graphs is not None and not graphs.failed  # captured, not fallen back to eager
        assert graphs.compiled == compiled  # a compiled engine did not fall back to the uncompiled forward
        await eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled decode captured as CUDA graphs)")
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
async def test_compiled_decode_matches_uncompiled_graphs(arch: str) -> None:
    kw = {"num_hidden_layers": 3, "mlp_only_layers": [1]} if arch == "qwen3_moe" else {"num_hidden_layers": 2}
    model = tiny_model(arch, **kw).cuda()  # fp32
    routed = arch == "qwen3_moe"
    eager = await _generate(model, False, routed)
    compiled = await _generate(model, True, routed)
    for a, b in zip(eager, compiled, strict=True):
        assert a.output_ids == b.output_ids
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)
        if routed:
            assert a.routed_experts is not None and b.routed_experts is not None
            assert np.array_equal(a.routed_experts, b.routed_experts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled decode captured as CUDA graphs)")
async def test_background_compile_serves_then_swaps_to_compiled_graphs() -> None:
    """engine.compile_background on the GPU: warm_up returns with uncompiled graphs, requests of
    several buckets run while the compile runs aside (buckets not yet captured decode eagerly, no
    capture overlaps the compile), then the compiled graphs are swapped in; tokens equal the
    uncompiled graphs' before and after."""
    model = tiny_model("qwen3", num_hidden_layers=2, hidden_size=80).cuda()  # a shape no other test compiled
    eager = await _generate(model, False)
    # compile_background is off by default since an H200 hit a caching-allocator assert with it
    # (issue 49): the test asks for it, so it keeps testing the mode rather than the default
    cfg = EngineConfig(device="cuda", max_batch_size=8, max_seq_len=300, kv_budget_tokens=0,
                       compile_background=True)
    assert cfg.compile_decode and cfg.compile_background
    eng = TorchEngine(model, cfg)
    prompts = [[1, 2, 3], [4] * 17, [5, 6], [7, 8, 9, 10, 11], list(range(40))]

    def reqs() -> list[GenerateRequest]:
        return [GenerateRequest(input_ids=p, sampling=SamplingParams(temperature=1.0, seed=i, max_new_tokens=n))
                for i, (p, n) in enumerate(zip(prompts, (4, 260, 3, 4, 6), strict=True))]

    try:
        await eng.warm_up()
        graphs = eng.stepper.graphs
        assert graphs is not None and not graphs.compiled
        during = await asyncio.gather(*(eng.generate(r) for r in reqs()))
        assert await eng.compile_done()
        after = await asyncio.gather(*(eng.generate(r) for r in reqs()))
        assert not graphs.failed and graphs.compiled
    finally:
        await eng.close()
    for a, b, c in zip(eager, during, after, strict=True):
        assert a.output_ids == b.output_ids == c.output_ids
        assert np.allclose(a.logprobs, c.logprobs, atol=1e-4)
