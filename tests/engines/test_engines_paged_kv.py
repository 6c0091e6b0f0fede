"""Paged KV (engine.kv_layout = "paged"): the same ids, logprobs and routing as the row pool,
shared prompt blocks, session reuse, admission by free blocks, and no leaked block.

The paged pool changes where keys live, not which rows a step batches (as long as admission is
limited by rows, not blocks). Under the batch-invariant kernels its results equal the row pool's
bit for bit: their attention pads keys and values into fresh contiguous tensors of one shape, so
both pools feed the same GEMMs the same operands. Under the default kernels the pools hand
attention different layouts (the row pool a strided view of its rows, the paged pool a
contiguous gather), and the CPU kernels may block those differently (vector width, threads):
there ids and routing are equal and logprobs agree within the fp32 rounding of the forward's
sums (tests/numerics.py), not bit for bit.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from numerics import assert_reduced_close

from miles.core.config import load_config
from miles.core.errors import ConfigError, EngineError
from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, GenerateResult, SamplingParams
from miles.engines.cuda_graph import DecodeGraphs
from miles.engines.paged_kv import PagedDecodeGraphs, PagedPool
from miles.engines.torch_engine import TorchEngine
from miles.models.decoder import CausalLM

from .conftest import tiny_model

pytestmark = pytest.mark.timeout(60)


def mixed_requests(routed: bool) -> list[GenerateRequest]:
    """Prompts of 3..27 tokens, 3..15 new tokens: sequences finish at different steps, and with
    three rows the later requests are admitted while others run; two are seeded samples."""
    reqs = []
    for i in range(7):
        prompt = [(7 * i + j) % 90 + 1 for j in range(3 + 4 * i)]
        temp, seed = (1.0, 10 + i) if i in (2, 5) else (0.0, None)
        sp = SamplingParams(temperature=temp, max_new_tokens=3 + (4 * i) % 13, seed=seed)
        reqs.append(GenerateRequest(input_ids=prompt, sampling=sp, return_routed_experts=routed))
    return reqs


def paged_cfg(**kw: object) -> EngineConfig:
    base: dict[str, object] = {"max_batch_size": 3, "max_seq_len": 64, "kv_layout": "paged", "kv_block_tokens": 4}
    return EngineConfig(**{**base, **kw})  # type: ignore[arg-type]


def assert_same(a: list[GenerateResult], b: list[GenerateResult], sums: tuple[int, int] | None = None) -> None:
    """Equal results. Logprobs bit for bit (both sides ran the batch-invariant kernels), or with
    `sums` = (longest sum, sums in sequence) of the forward, within that much fp32 rounding."""
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids
        if sums is None:
            assert x.logprobs == y.logprobs  # bit for bit, not approximately
        else:
            assert_reduced_close(x.logprobs, y.logprobs, k=sums[0], depth=sums[1])
        assert x.cached_tokens == y.cached_tokens and x.finish_reason == y.finish_reason
        if x.routed_experts is None:
            assert y.routed_experts is None
        else:
            assert y.routed_experts is not None and np.array_equal(x.routed_experts, y.routed_experts)


def sums(model: CausalLM, keys: int) -> tuple[int, int]:
    """(longest sum, sums in sequence) of a decode forward reading `keys` keys: the widest of
    the hidden, MLP, vocabulary (log-softmax) and key axes, once per layer and once in the head."""
    sp = model.spec
    return max(sp.hidden_size, sp.intermediate_size, sp.vocab_size, keys), sp.num_layers + 1


def assert_all_free(eng: TorchEngine) -> None:
    pool = eng.pool
    assert isinstance(pool, PagedPool)
    assert sorted(pool.free) == list(range(pool.num_blocks))  # every block once: no leak, no double free
    assert not any(pool.refs) and not any(pool.tables) and pool.outstanding() == 0


class Recording(TorchEngine):
    """The engine, recording the most rows its admissions left running (`most_running`)."""

    most_running = 0

    def _admit(self) -> list:  # type: ignore[type-arg]
        new = super()._admit()
        self.most_running = max(self.most_running, len(self._running))
        return new


async def run(model: CausalLM, cfg: EngineConfig, reqs: list[GenerateRequest], invariant: bool = False
              ) -> tuple[list[GenerateResult], TorchEngine]:
    eng = TorchEngine(model, cfg, batch_invariant=invariant)
    try:
        out = list(await asyncio.gather(*(eng.generate(r) for r in reqs)))
        if isinstance(eng.pool, PagedPool):
            assert_all_free(eng)  # before close, which frees every row
        return out, eng
    finally:
        await eng.close()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
async def test_paged_equals_rows(arch: str) -> None:
    model = tiny_model(arch) if arch == "qwen3" else tiny_model(arch, num_hidden_layers=3, mlp_only_layers=[1])
    reqs = mixed_requests(routed=arch == "qwen3_moe")
    rows, _ = await run(model, EngineConfig(max_batch_size=3, max_seq_len=64), reqs)
    paged, eng = await run(model, paged_cfg(), reqs)
    assert_same(rows, paged, sums(model, 64))  # default kernels: see the module doc
    assert all(r.finish_reason == "length" for r in paged) and len({len(r.output_ids) for r in paged}) > 3
    if arch == "qwen3_moe":
        assert all(r.routed_experts is not None for r in paged)
    assert eng.pool.bytes_per_token() > 0


@pytest.mark.parametrize("invariant", [False, True], ids=["default_kernels", "batch_invariant"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
async def test_graph_layout_equals_rows(arch: str, invariant: bool) -> None:
    """The decode-graph layout (batch padded to a bucket, keys to a power of two >= 256) run
    eagerly on the CPU: over the paged pool it gives what it gives over the row pool, bit for
    bit under the batch-invariant kernels, within fp32 rounding under the default ones."""
    model = tiny_model(arch) if arch == "qwen3" else tiny_model(arch, num_hidden_layers=3, mlp_only_layers=[1])
    reqs = mixed_requests(routed=arch == "qwen3_moe")
    out = {}
    for layout in ("rows", "paged"):
        eng = TorchEngine(model, paged_cfg(kv_layout=layout, max_seq_len=300), batch_invariant=invariant)
        pool = eng.pool
        graphs = (PagedDecodeGraphs(eng.model, pool, capture=False) if isinstance(pool, PagedPool)
                  else DecodeGraphs(eng.model, pool, capture=False))
        eng.stepper.graphs = graphs
        try:
            out[layout] = list(await asyncio.gather(*(eng.generate(r) for r in reqs)))
            assert not graphs.failed  # no fallback to the plain decode
            if isinstance(pool, PagedPool):
                assert_all_free(eng)
        finally:
            await eng.close()
    assert_same(out["rows"], out["paged"], None if invariant else sums(model, 301))


async def test_admission_waits_for_blocks(dense_model: CausalLM) -> None:
    """A pool of 12 blocks, requests of 3 blocks each (9 prompt + 3 new tokens): four run at a
    time although eight rows are free, and all finish equal to the row pool's results."""
    reqs = [GenerateRequest(input_ids=[(5 * i + j) % 90 + 1 for j in range(9)],
                            sampling=SamplingParams(temperature=0.0, max_new_tokens=3)) for i in range(10)]
    cfg = paged_cfg(max_batch_size=8, kv_pool_tokens=48, share_prompts=False)
    eng = Recording(dense_model, cfg, batch_invariant=True)
    try:
        paged = list(await asyncio.gather(*(eng.generate(r) for r in reqs)))
        assert eng.most_running == 4
        assert eng.stats()["kv_blocks"] == 12 and eng.stats()["kv_blocks_used"] == 0
        assert_all_free(eng)
    finally:
        await eng.close()
    rows, _ = await run(dense_model, EngineConfig(max_batch_size=8, max_seq_len=64), reqs, invariant=True)
    assert_same(rows, paged)


async def test_group_followers_reserve_only_what_they_do_not_share(dense_model: CausalLM) -> None:
    """A group of 8 (21-token prompt, 6 new: 7 blocks of 4 each unshared) in a pool of 24 blocks:
    the leader reserves 7, each follower 2 (its 5 full prompt blocks are the leader's), so all
    eight run together; unshared, three fit at a time. Results equal either way."""
    group = [(3 * j) % 90 + 1 for j in range(21)]
    reqs = [GenerateRequest(input_ids=list(group), sampling=SamplingParams(temperature=1.0, max_new_tokens=6,
                                                                           seed=i)) for i in range(8)]
    outs, peaks = {}, {}
    for share in (True, False):
        eng = Recording(dense_model, paged_cfg(max_batch_size=8, kv_pool_tokens=96, share_prompts=share),
                        batch_invariant=True)
        try:
            outs[share] = list(await asyncio.gather(*(eng.generate(r) for r in reqs)))
            peaks[share] = eng.most_running
            assert eng.stats()["kv_blocks_peak"] <= 24
            assert_all_free(eng)
        finally:
            await eng.close()
    assert peaks == {True: 8, False: 3}
    assert_same(outs[True], outs[False])


async def test_group_shares_prompt_blocks(dense_model: CausalLM) -> None:
    """A GRPO group of 8 (21-token prompt: 5 full blocks + 1 partial) and two prompts that begin
    alike for 64 tokens (engines/prompt_share.py shares whole 64-token blocks): with sharing the
    pool holds fewer blocks than without, and the outputs equal the unshared run's. Five rows
    for ten requests: later samples copy a running row's prompt (its full blocks by reference)."""
    group = [(3 * j) % 90 + 1 for j in range(21)]
    common = [(11 * j) % 90 + 1 for j in range(64)]
    prompts = [group] * 8 + [common + [1, 2, 3], common + [4, 5]]
    reqs = [GenerateRequest(input_ids=list(p), sampling=SamplingParams(temperature=1.0, max_new_tokens=4 + i % 3,
                                                                        seed=i)) for i, p in enumerate(prompts)]
    peaks, outs = {}, {}
    for share in (True, False):
        cfg = paged_cfg(max_batch_size=5, max_seq_len=96, share_prompts=share)
        outs[share], eng = await run(dense_model, cfg, reqs, invariant=True)
        peaks[share] = eng.stats()["kv_blocks_peak"]
        if share:
            assert eng.stats()["shared_prompt_tokens"] > 4 * len(group)  # and later samples copied too
    # most blocks in use at once (53 unshared, 29 shared at this writing): five running samples of a
    # 21-token prompt hold 5 x 6 blocks unshared, 5 + 5 x 1 shared (the partial block is copied)
    assert peaks[False] >= 5 * 6 and 3 * peaks[True] < 2 * peaks[False]
    assert_same(outs[True], outs[False])
    rows, _ = await run(dense_model, EngineConfig(max_batch_size=5, max_seq_len=96), reqs[:5], invariant=True)
    assert_same(rows, outs[True][:5])


async def test_session_reuse_equals_rows(dense_model: CausalLM) -> None:
    async def turns(cfg: EngineConfig) -> tuple[list[GenerateResult], TorchEngine]:
        eng = TorchEngine(dense_model, cfg)
        try:
            sp = SamplingParams(temperature=0.7, max_new_tokens=6, seed=3)
            first = await asyncio.gather(*(eng.generate(GenerateRequest(
                input_ids=[(i + j) % 90 + 1 for j in range(5 + 6 * i)], sampling=sp, session_key=f"s{i}"))
                for i in range(3)))
            second = await asyncio.gather(*(eng.generate(GenerateRequest(
                input_ids=[(i + j) % 90 + 1 for j in range(5 + 6 * i)] + first[i].output_ids + [7, 8],
                sampling=sp, session_key=f"s{i}")) for i in range(3)))
            if isinstance(eng.pool, PagedPool):
                assert_all_free(eng)
            return [*first, *second], eng
        finally:
            await eng.close()

    rows, _ = await turns(EngineConfig(max_batch_size=3, max_seq_len=64))
    paged, _ = await turns(paged_cfg())
    assert [r.cached_tokens for r in paged[3:]] == [5 + 6 * i + 6 for i in range(3)]  # the whole history
    assert_same(rows, paged, sums(dense_model, 64))  # default kernels: see the module doc


async def test_abort_and_retract_free_blocks(dense_model: CausalLM) -> None:
    eng = TorchEngine(dense_model, paged_cfg(max_batch_size=4, max_seq_len=512))
    try:
        sp = SamplingParams(temperature=0.0, max_new_tokens=500)  # still running at the pause
        reqs = [GenerateRequest(input_ids=[1, 2, 3, i + 4], sampling=sp) for i in range(6)]
        tasks = [asyncio.ensure_future(eng.generate(r)) for r in reqs]
        while eng.health().running < 4:
            await asyncio.sleep(0.001)
        assert await eng.abort(reqs[0].request_id)
        out = await eng.pause("retract")
        assert len(out) == 5 and (await tasks[0]).finish_reason == "abort"
        assert_all_free(eng)
        assert all(t.done() for t in tasks)
    finally:
        await eng.close()


async def test_oversized_request_is_refused(dense_model: CausalLM) -> None:
    eng = TorchEngine(dense_model, paged_cfg(kv_block_tokens=16, kv_pool_tokens=32))
    try:
        big = GenerateRequest(input_ids=list(range(1, 31)), sampling=SamplingParams(max_new_tokens=10))
        with pytest.raises(EngineError, match=r"needs 3 KV blocks of 16 tokens, but the paged pool holds 2"):
            await eng.generate(big)
        ok = await eng.generate(GenerateRequest(input_ids=list(range(1, 21)),
                                                sampling=SamplingParams(temperature=0.0, max_new_tokens=12)))
        assert len(ok.output_ids) == 12
        assert_all_free(eng)
    finally:
        await eng.close()


def test_layout_options_are_checked() -> None:
    cfg = load_config(EngineConfig, None, ["kv_layout=paged", "kv_block_tokens=32", "kv_pool_tokens=4096"])
    assert (cfg.kv_layout, cfg.kv_block_tokens, cfg.kv_pool_tokens) == ("paged", 32, 4096)
    with pytest.raises(ConfigError, match="'pages' is not one of"):
        load_config(EngineConfig, None, ["kv_layout=pages"])
    with pytest.raises(ConfigError, match="kv_block_tokens=0"):
        EngineConfig(kv_layout="paged", kv_block_tokens=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [True, False])
async def test_paged_on_cuda_matches_rows(graphs: bool) -> None:
    """On CUDA, with decode graphs (captured over the paged pool) or without: the attention
    kernels may take other paths for the gathered (contiguous) and the sliced (strided) K/V, so
    logprobs are compared to 1e-5; ids and routing exactly."""
    model = tiny_model("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1]).cuda()
    reqs = mixed_requests(routed=True)
    rows, _ = await run(model, EngineConfig(device="cuda", max_batch_size=3, max_seq_len=64, cuda_graphs=graphs),
                        reqs)
    eng = TorchEngine(model, paged_cfg(device="cuda", cuda_graphs=graphs))
    try:
        paged = list(await asyncio.gather(*(eng.generate(r) for r in reqs)))
        g = eng.stepper.graphs
        assert (isinstance(g, PagedDecodeGraphs) and not g.failed) if graphs else g is None
        assert_all_free(eng)
    finally:
        await eng.close()
    for x, y in zip(rows, paged, strict=True):
        assert x.output_ids == y.output_ids
        assert np.allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5)
        assert x.routed_experts is not None and y.routed_experts is not None
        assert np.array_equal(x.routed_experts, y.routed_experts)
