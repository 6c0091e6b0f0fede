"""engine.overlap_decode: decode steps launched one ahead (step k+1 fed on the device from step k's
ids before the host reads them) give exactly what the step-by-step decode gives: tokens,
logprobs, finish reasons, routing and session KV, while sequences stop on stop ids, run out of
tokens, flush for routing and sessions, and join mid-run. Both engines run the decode graphs'
padded layout eagerly on the CPU (capture=False)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, GenerateResult, SamplingParams
from miles.engines.cuda_graph import DecodeGraphs
from miles.engines.stepper import Stepper
from miles.engines.torch_engine import TorchEngine

from .conftest import tiny_model

pytestmark = pytest.mark.timeout(120)


def _engine(model, overlap: bool) -> TorchEngine:
    cfg = EngineConfig(max_batch_size=8, max_seq_len=200, kv_budget_tokens=4000, overlap_decode=overlap)
    eng = TorchEngine(model, cfg)
    eng.stepper.graphs = DecodeGraphs(eng.model, eng.pool, capture=False)
    return eng


def _req(i: int, prompt: list[int], n: int, routed: bool, session: bool) -> GenerateRequest:
    sp = SamplingParams(temperature=1.0 if i % 3 else 0.0, seed=i, max_new_tokens=n,
                        stop_token_ids=[5, 11, 17] if i % 2 else [])
    return GenerateRequest(input_ids=prompt, sampling=sp, return_routed_experts=routed,
                           session_key=f"s{i}" if session else None)


async def _workload(eng: TorchEngine, routed: bool) -> list[GenerateResult]:
    prompts = [[1, 2, 3], [4] * 17, [5, 6], [7, 8, 9, 10, 11], list(range(40)), [9, 9], [3] * 30]
    lens = (6, 40, 90, 4, 25, 60, 13)
    try:
        first = [asyncio.create_task(eng.generate(_req(i, p, n, routed, i in (1, 4))))
                 for i, (p, n) in enumerate(zip(prompts[:3], lens[:3], strict=True))]
        while eng.stats()["generated_tokens"] < 5:  # the rest join while these decode
            await asyncio.sleep(0)
        rest = [asyncio.create_task(eng.generate(_req(i + 3, p, n, routed, i + 3 in (1, 4))))
                for i, (p, n) in enumerate(zip(prompts[3:], lens[3:], strict=True))]
        out = list(await asyncio.gather(*first, *rest))
        # second turns of the sessions: they reuse the KV the first turns left (flushed)
        for i in (1, 4):
            turn2 = prompts[i] + out[i].output_ids + [2, 3]
            out.append(await eng.generate(_req(i, turn2, 12, routed, True)))
        return out
    finally:
        await eng.close()


def _assert_same(a: list[GenerateResult], b: list[GenerateResult]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids
        # equal up to the rounding of a different padded batch: when a joining request is
        # admitted between steps depends on timing, which differs between the two engines
        assert np.allclose(x.logprobs, y.logprobs, atol=1e-4)
        assert x.finish_reason == y.finish_reason
        assert x.cached_tokens == y.cached_tokens
        if x.routed_experts is None:
            assert y.routed_experts is None
        else:
            assert y.routed_experts is not None and np.array_equal(x.routed_experts, y.routed_experts)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
async def test_overlapped_decode_equals_step_by_step(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = {"num_hidden_layers": 3, "mlp_only_layers": [1]} if arch == "qwen3_moe" else {}
    model = tiny_model(arch, **kw)
    routed = arch == "qwen3_moe"
    launched: list[int] = []
    real_launch = Stepper.launch

    def counting_launch(self: Stepper, seqs, prev):  # a spy: the real launch runs
        launched.append(len(seqs))
        return real_launch(self, seqs, prev)

    monkeypatch.setattr(Stepper, "launch", counting_launch)
    fed: list[tuple[int, int]] = []  # (KV length, tokens) of every sequence as it finishes
    real_finalize = TorchEngine._finalize

    def recording_finalize(self: TorchEngine, seq, reason, retracted=False):  # a spy as well
        fed.append((seq.kv_len, len(seq.tokens) - (0 if seq.wants_flush else 1)))
        return real_finalize(self, seq, reason, retracted)

    monkeypatch.setattr(TorchEngine, "_finalize", recording_finalize)
    stepwise = await _workload(_engine(model, overlap=False), routed)
    assert not launched
    overlapped = await _workload(_engine(model, overlap=True), routed)
    assert len(launched) > 50  # most steps ran one ahead
    _assert_same(stepwise, overlapped)
    # a finished sequence's KV covers its tokens (all of them once flushed), never a dropped step's
    assert len(fed) == 2 * len(stepwise) and all(kv == n for kv, n in fed)
    # the workload does what it is meant to: stops on stop ids, on length, and reuses sessions
    reasons = {r.finish_reason for r in stepwise}
    assert reasons == {"stop", "length"}
    assert all(r.cached_tokens > 0 for r in stepwise[-2:])
    if routed:  # routing covers every fed token: prompt + output - 1, plus the flushed last one
        for r, p_len in zip(stepwise[:7], (3, 17, 2, 5, 40, 2, 30), strict=True):
            assert r.routed_experts is not None and r.routed_experts.shape[0] == p_len + len(r.output_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (captured decode graphs, pinned copies)")
async def test_overlapped_captured_decode_equals_step_by_step_on_cuda() -> None:
    """The same on real CUDA graphs (uncompiled, fp32): ids fed on the device, the tokens read
    through pinned memory after an event, rows dropped at finish."""
    model = tiny_model("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1]).cuda()

    def engine(overlap: bool) -> TorchEngine:
        cfg = EngineConfig(device="cuda", max_batch_size=8, max_seq_len=200, kv_budget_tokens=4000,
                           overlap_decode=overlap, compile_decode=False)
        return TorchEngine(model, cfg)

    stepwise = await _workload(engine(False), True)
    overlapped = await _workload(engine(True), True)
    _assert_same(stepwise, overlapped)
