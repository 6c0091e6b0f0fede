"""engine.compile_decode on the CPU: the decode graphs' forward under torch.compile (run without
capture here) gives the tokens of the uncompiled forward; engines of one process share one
compile, whatever their pool size; and a compile that fails falls back to the uncompiled forward
instead of failing requests; with engine.compile_background the engine answers before its compile
is ready and gives the same tokens after the swap. (The CUDA-graph capture of it:
test_engines_compiled_decode.py.)"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from miles.core.schema.engine import EngineConfig
from miles.engines import cuda_graph
from miles.engines.base import GenerateRequest, GenerateResult, SamplingParams
from miles.engines.cuda_graph import DecodeGraphs
from miles.engines.torch_engine import TorchEngine
from miles.models.decoder import CausalLM

from .conftest import tiny_model

pytestmark = pytest.mark.timeout(240)


def _broken_compile(cls: type) -> object:
    """Fault injection for `_compiled_forward`: the compiler raises as Inductor would."""
    def run(*args: object) -> object:
        raise RuntimeError("InductorError: simulated compile failure")
    return run


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Each test starts from Dynamo's state of a fresh process, so the same tiny model compiles
    again in each and its counts are its own; the session's Inductor cache (tests/conftest.py)
    then serves the kernels the first test built, instead of a cold C++ build per test."""
    torch._dynamo.reset()


async def _generate(model: CausalLM, rows: int, compiled: bool) -> tuple[list[GenerateResult], DecodeGraphs]:
    eng = TorchEngine(model, EngineConfig(max_batch_size=rows, max_seq_len=64, kv_budget_tokens=0))
    graphs = eng.stepper.graphs = DecodeGraphs(eng.model, eng.pool, capture=False, compiled=compiled)
    prompts = [[1, 2, 3], [4] * 9, [5, 6]]
    reqs = [GenerateRequest(input_ids=p, sampling=SamplingParams(temperature=1.0, seed=i, max_new_tokens=8 + i))
            for i, p in enumerate(prompts)]
    try:
        return list(await asyncio.gather(*(eng.generate(r) for r in reqs))), graphs
    finally:
        await eng.close()


async def test_compiled_decode_equals_uncompiled_and_compiles_once() -> None:
    model = tiny_model("qwen3", num_hidden_layers=1)
    plain, _ = await _generate(model, 4, compiled=False)
    before = counters["stats"]["unique_graphs"]
    first, g1 = await _generate(model, 4, compiled=True)
    second, g2 = await _generate(model, 8, compiled=True)  # another pool size: the same compile
    assert g1.compiled and g2.compiled  # neither fell back
    assert counters["stats"]["unique_graphs"] - before == 1
    for a, b, c in zip(plain, first, second, strict=True):
        assert a.output_ids == b.output_ids == c.output_ids
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4) and np.allclose(a.logprobs, c.logprobs, atol=1e-4)


async def test_a_failing_compile_falls_back_to_the_uncompiled_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("qwen3", num_hidden_layers=1)
    plain, _ = await _generate(model, 4, compiled=False)
    monkeypatch.setattr(cuda_graph, "_compiled_forward", _broken_compile)
    fell_back, graphs = await _generate(model, 4, compiled=True)
    assert not graphs.compiled and not graphs.failed  # uncompiled, still the decode graphs' path
    for a, b in zip(plain, fell_back, strict=True):
        assert a.output_ids == b.output_ids and a.logprobs == b.logprobs


async def test_warm_up_compiles_before_the_first_request() -> None:
    model = tiny_model("qwen3", num_hidden_layers=1)
    eng = TorchEngine(model, EngineConfig(max_batch_size=4, max_seq_len=64, kv_budget_tokens=0,
                                          compile_background=False))
    graphs = eng.stepper.graphs = DecodeGraphs(eng.model, eng.pool, capture=False, compiled=True)
    before = counters["stats"]["unique_graphs"]
    try:
        await eng.warm_up()
        assert counters["stats"]["unique_graphs"] - before == 1 and graphs.compiled
        await asyncio.gather(*(eng.generate(GenerateRequest(input_ids=[1, 2, 3 + i],
                                                            sampling=SamplingParams(max_new_tokens=5)))
                               for i in range(3)))
        assert counters["stats"]["unique_graphs"] - before == 1  # the requests reused it
    finally:
        await eng.close()


async def test_background_compile_serves_before_it_is_ready_and_swaps_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.compile_background: requests are answered while the compile is held back, and after
    the swap the compiled forward gives the same tokens."""
    import threading

    gate = threading.Event()
    real = cuda_graph._compiled_forward

    def held(cls: type) -> object:  # the compile waits for the test, then runs for real
        fn = real(cls)

        def run(*args: object) -> object:
            gate.wait(120)
            return fn(*args)
        return run

    model = tiny_model("qwen3", num_hidden_layers=1)
    plain, _ = await _generate(model, 4, compiled=False)
    monkeypatch.setattr(cuda_graph, "_compiled_forward", held)
    eng = TorchEngine(model, EngineConfig(max_batch_size=4, max_seq_len=64, kv_budget_tokens=0,
                                          compile_background=True))  # opt-in since its first H200 run
    graphs = eng.stepper.graphs = DecodeGraphs(eng.model, eng.pool, capture=False, compiled=True)
    prompts = [[1, 2, 3], [4] * 9, [5, 6]]

    def reqs() -> list[GenerateRequest]:
        return [GenerateRequest(input_ids=p, sampling=SamplingParams(temperature=1.0, seed=i, max_new_tokens=8 + i))
                for i, p in enumerate(prompts)]

    before = counters["stats"]["unique_graphs"]
    try:
        await eng.warm_up()  # returns at once: the compile waits on the gate in a worker thread
        assert not graphs.compiled
        early = await asyncio.gather(*(eng.generate(r) for r in reqs()))
        assert not graphs.compiled and not gate.is_set()  # answered while the compile had not run
        gate.set()
        assert await eng.compile_done() and graphs.compiled
        assert counters["stats"]["unique_graphs"] - before == 1  # compiled once, aside
        late = await asyncio.gather(*(eng.generate(r) for r in reqs()))
        assert counters["stats"]["unique_graphs"] - before == 1  # the swap reused it
    finally:
        gate.set()
        await eng.close()
    for a, b, c in zip(plain, early, late, strict=True):
        assert a.output_ids == b.output_ids == c.output_ids
        assert np.allclose(a.logprobs, c.logprobs, atol=1e-4)


async def _engine_run(model: CausalLM, compile_cpu: bool, routed: bool = False) -> tuple[list[GenerateResult], TorchEngine]:
    """engine.compile_decode_cpu through the engine's own config (not a hand-set DecodeGraphs):
    greedy and seeded requests of different lengths, two of them joining mid-run."""
    eng = TorchEngine(model, EngineConfig(max_batch_size=4, max_seq_len=64, kv_budget_tokens=0,
                                          compile_decode_cpu=compile_cpu))
    prompts = [[1, 2, 3], [4] * 9, [5, 6], [7, 8, 9, 10]]
    reqs = [GenerateRequest(input_ids=p, return_routed_experts=routed,
                            sampling=SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i, max_new_tokens=6 + 3 * i))
            for i, p in enumerate(prompts)]
    try:
        first = [asyncio.create_task(eng.generate(r)) for r in reqs[:2]]
        while eng.stats()["generated_tokens"] < 3:
            await asyncio.sleep(0)
        rest = [asyncio.create_task(eng.generate(r)) for r in reqs[2:]]
        return list(await asyncio.gather(*first, *rest)), eng
    finally:
        await eng.close()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
async def test_compile_decode_cpu_option_gives_the_eager_engines_tokens(arch: str) -> None:
    kw = {"num_hidden_layers": 3, "mlp_only_layers": [1]} if arch == "qwen3_moe" else {"num_hidden_layers": 1}
    model = tiny_model(arch, **kw)
    routed = arch == "qwen3_moe"
    eager, plain = await _engine_run(model, False, routed)
    assert plain.stepper.graphs is None  # off by default: the CPU engine decodes eagerly
    compiled, eng = await _engine_run(model, True, routed)
    graphs = eng.stepper.graphs
    assert graphs is not None and graphs.compiled and not graphs.failed
    for a, b in zip(eager, compiled, strict=True):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)
        if routed:  # the experts run densely under the compile: the same choice
            assert a.routed_experts is not None and b.routed_experts is not None
            assert np.array_equal(a.routed_experts, b.routed_experts)


async def test_compile_decode_cpu_whose_compile_fails_decodes_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("qwen3", num_hidden_layers=1)
    eager, _ = await _engine_run(model, False)
    monkeypatch.setattr(cuda_graph, "_compiled_forward", _broken_compile)
    fell_back, eng = await _engine_run(model, True)
    graphs = eng.stepper.graphs
    assert graphs is not None and graphs.failed and not graphs.compiled  # eager from then on
    for a, b in zip(eager, fell_back, strict=True):
        assert a.output_ids == b.output_ids
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)


async def test_compile_decode_cpu_in_the_background_whose_compile_fails_decodes_eagerly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.compile_background with compile_decode_cpu: the engine serves at once (uncompiled),
    and when the compile aside fails it decodes eagerly, with the eager engine's tokens."""
    model = tiny_model("qwen3", num_hidden_layers=1)
    eager, _ = await _engine_run(model, False)
    monkeypatch.setattr(cuda_graph, "_compiled_forward", _broken_compile)
    eng = TorchEngine(model, EngineConfig(max_batch_size=4, max_seq_len=64, kv_budget_tokens=0,
                                          compile_decode_cpu=True, compile_background=True))
    prompts = [[1, 2, 3], [4] * 9, [5, 6], [7, 8, 9, 10]]
    reqs = [GenerateRequest(input_ids=p, sampling=SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i,
                                                                 max_new_tokens=6 + 3 * i))
            for i, p in enumerate(prompts)]
    try:
        await eng.warm_up()
        assert not await eng.compile_done()
        graphs = eng.stepper.graphs
        assert graphs is not None and graphs.failed  # eager from now on
        late = await asyncio.gather(*(eng.generate(r) for r in reqs))
    finally:
        await eng.close()
    for a, b in zip(eager, late, strict=True):
        assert a.output_ids == b.output_ids
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)
