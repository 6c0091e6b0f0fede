"""The CUDA-graph decode layout (batch padded to a bucket with scratch-writing pad rows, keys
padded to a power-of-two length under the causal mask), run eagerly on the CPU: it must give
the same tokens, logprobs and routing as the plain decode."""

from __future__ import annotations

import asyncio

import numpy as np

from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.cuda_graph import DecodeGraphs
from miles.engines.torch_engine import TorchEngine

from .conftest import tiny_model


async def _run(eng: TorchEngine, reqs: list[GenerateRequest]):
    """The first three requests start alone; the rest join while they decode, so prefills land in
    rows that the padded decode batch covers (pad rows must leave them intact)."""
    try:
        first = [asyncio.create_task(eng.generate(r)) for r in reqs[:3]]
        while eng.stats()["generated_tokens"] < 4:
            await asyncio.sleep(0)
        rest = [asyncio.create_task(eng.generate(r)) for r in reqs[3:]]
        return await asyncio.gather(*first, *rest)
    finally:
        await eng.close()


def _reqs(routed: bool) -> list[GenerateRequest]:
    # 3 and 5 rows pad to buckets 4 and 8; lengths differ, so the mask does real work;
    # 300 tokens cross the 256-key bucket
    prompts = [[1, 2, 3], [4] * 17, [5, 6], [7, 8, 9, 10, 11], list(range(40))]
    return [
        GenerateRequest(
            input_ids=p, return_routed_experts=routed,
            sampling=SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_new_tokens=n),
        )
        for i, (p, n) in enumerate(zip(prompts, (6, 9, 300, 4, 12), strict=True))
    ]


def _engine(model, graphs: bool) -> TorchEngine:
    eng = TorchEngine(model, EngineConfig(max_batch_size=8, max_seq_len=320, kv_budget_tokens=0))
    if graphs:
        eng.stepper.graphs = DecodeGraphs(eng.model, eng.pool, capture=False)
    return eng


async def test_padded_bucketed_decode_matches_plain_decode() -> None:
    model = tiny_model("qwen3")
    plain = await _run(_engine(model, False), _reqs(False))
    padded = await _run(_engine(model, True), _reqs(False))
    for a, b in zip(plain, padded, strict=True):
        assert a.output_ids == b.output_ids
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)


async def test_padded_decode_of_moe_returns_the_same_routing() -> None:
    model = tiny_model("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])
    reqs = _reqs(True)[:4]
    plain = await _run(_engine(model, False), reqs)
    padded = await _run(_engine(model, True), reqs)
    for a, b in zip(plain, padded, strict=True):
        assert a.output_ids == b.output_ids
        assert a.routed_experts is not None and b.routed_experts is not None
        assert np.array_equal(a.routed_experts, b.routed_experts)


async def test_moe_graphs_serve_requests_with_and_without_routing_together() -> None:
    """A MoE model's decode graphs always record routing (one graph per bucket for both kinds of
    request); only the requests that ask for it get it back."""
    model = tiny_model("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])
    reqs = [r if i % 2 else GenerateRequest(input_ids=r.input_ids, sampling=r.sampling)
            for i, r in enumerate(_reqs(True)[:4])]
    plain = await _run(_engine(model, False), reqs)
    padded = await _run(_engine(model, True), reqs)
    for i, (a, b) in enumerate(zip(plain, padded, strict=True)):
        assert a.output_ids == b.output_ids
        if i % 2:
            assert a.routed_experts is not None and b.routed_experts is not None
            assert np.array_equal(a.routed_experts, b.routed_experts)
        else:
            assert a.routed_experts is None and b.routed_experts is None
