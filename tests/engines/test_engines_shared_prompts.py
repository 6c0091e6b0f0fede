"""Shared prompt prefill (engine.share_prompts): a group's samples equal the unshared engine's.

Bit for bit under batch-invariant kernels, where a row's numbers cannot depend on which rows
share its forward; in the default mode sharing changes the prefill's batch composition, which
moves logprobs by float rounding only (as any other batching does), and the ids stay equal.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from numerics import assert_reduced_close, forward_sums

from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, GenerateResult, SamplingParams
from miles.engines.torch_engine import TorchEngine
from miles.models.decoder import CausalLM

from .conftest import VOCAB, tiny_model

pytestmark = pytest.mark.timeout(60)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 2, 3], [40, 41, 42, 43, 44, 45]]


def group_requests(n: int, temperature: float, routed: bool) -> list[GenerateRequest]:
    """n samples of every prompt, interleaved as a rollout would send them; sample i of a
    group has seed 100 * g + i, and (routed) only odd samples ask for routing, so some
    followers want routing that their leader does not."""
    reqs = []
    for i in range(n):
        for g, p in enumerate(PROMPTS):
            sp = SamplingParams(temperature=temperature, max_new_tokens=7 + g, seed=100 * g + i)
            reqs.append(GenerateRequest(input_ids=list(p), sampling=sp, return_routed_experts=routed and i % 2 == 1))
    return reqs


async def run(
    model: CausalLM, reqs: list[GenerateRequest], share: bool, rows: int, invariant: bool = True
) -> tuple[list[GenerateResult], int]:
    cfg = EngineConfig(max_batch_size=rows, max_seq_len=64, share_prompts=share)
    eng = TorchEngine(model, cfg, batch_invariant=invariant)
    try:
        out = await asyncio.gather(*(eng.generate(r) for r in reqs))
        return list(out), int(eng.stats()["shared_prompt_tokens"])
    finally:
        await eng.close()


def assert_same(a: list[GenerateResult], b: list[GenerateResult], sums: tuple[int, int] | None = None) -> None:
    """Logprobs bit for bit, or with `sums` = (k, depth) within the fp32 rounding of the forward."""
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids
        if sums is None:
            assert x.logprobs == y.logprobs  # bit for bit, not approximately
        else:
            assert_reduced_close(x.logprobs, y.logprobs, k=sums[0], depth=sums[1])
        assert x.prompt_tokens == y.prompt_tokens and x.cached_tokens == y.cached_tokens
        if x.routed_experts is None:
            assert y.routed_experts is None
        else:
            assert y.routed_experts is not None and np.array_equal(x.routed_experts, y.routed_experts)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
async def test_shared_prompt_groups_equal_unshared(arch: str, temperature: float) -> None:
    model = tiny_model(arch, num_hidden_layers=3) if arch == "qwen3" else tiny_model(
        arch, num_hidden_layers=3, mlp_only_layers=[1])
    reqs = group_requests(4, temperature, routed=arch == "qwen3_moe")
    shared, n_shared = await run(model, reqs, share=True, rows=16)
    plain, n_plain = await run(model, reqs, share=False, rows=16)
    assert n_shared == 3 * sum(len(p) for p in PROMPTS) and n_plain == 0  # 3 followers per prompt
    assert_same(shared, plain)
    if arch == "qwen3_moe":  # every asking sample carries its prompt's routing, followers included
        for r, q in zip(shared, reqs, strict=True):
            assert (r.routed_experts is not None) == q.return_routed_experts
            if r.routed_experts is not None:
                assert r.routed_experts.shape[0] == r.prompt_tokens + len(r.output_ids)
    if temperature > 0:  # seeded per request: samples of one prompt differ from each other
        assert len({tuple(r.output_ids) for r in shared[::3]}) > 1


async def test_groups_split_by_a_full_batch_still_match(dense_model: CausalLM) -> None:
    """Five rows for twelve requests: groups are cut across admissions and rows are reused."""
    reqs = group_requests(4, 1.0, routed=False)
    shared, n_shared = await run(dense_model, reqs, share=True, rows=5)
    plain, _ = await run(dense_model, reqs, share=False, rows=5)
    assert n_shared > 0
    assert_same(shared, plain)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_default_kernels_keep_ids_and_logprobs_to_rounding(dense_model: CausalLM, temperature: float) -> None:
    reqs = group_requests(4, temperature, routed=False)
    shared, n_shared = await run(dense_model, reqs, share=True, rows=16, invariant=False)
    plain, _ = await run(dense_model, reqs, share=False, rows=16, invariant=False)
    assert n_shared > 0
    assert_same(shared, plain, forward_sums(dense_model.spec, 64))


async def test_stored_session_is_restored_not_shared(dense_model: CausalLM) -> None:
    eng = TorchEngine(dense_model, EngineConfig(max_batch_size=8, max_seq_len=64))
    try:
        greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
        first = await eng.generate(GenerateRequest(input_ids=PROMPTS[0], sampling=greedy, session_key="s"))
        turn2 = PROMPTS[0] + first.output_ids + [3]
        reqs = [GenerateRequest(input_ids=list(turn2), sampling=greedy, session_key=k) for k in ("s", None, None)]
        res = await asyncio.gather(*(eng.generate(r) for r in reqs))
        assert res[0].cached_tokens == len(turn2) - 1  # the session's KV, not a copy of a leader's
        assert eng.stats()["shared_prompt_tokens"] == len(turn2)  # the third copies the second
        assert res[0].output_ids == res[1].output_ids == res[2].output_ids
    finally:
        await eng.close()


async def until_running(eng: TorchEngine, n: int) -> None:
    for _ in range(2000):
        if eng.health().running >= n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"engine never had {n} running requests")


async def late_group(
    model: CausalLM, share: bool, routed: tuple[bool, bool], commit_between: bool = False,
    prompts: tuple[list[int], ...] = (PROMPTS[0],) * 4,
) -> tuple[list[GenerateResult], int]:
    """Sample 0 of a group runs alone; samples 1-3 arrive while it is running (held back by an
    in-place pause, so they are admitted together in the next iteration, while it still runs)."""
    eng = TorchEngine(model, EngineConfig(max_batch_size=8, max_seq_len=320, share_prompts=share),
                      batch_invariant=True)
    try:
        def r(i: int) -> GenerateRequest:
            sp = SamplingParams(temperature=1.0, max_new_tokens=20 if i == 0 else 6, seed=i)
            return GenerateRequest(input_ids=list(prompts[i]), sampling=sp, return_routed_experts=routed[i > 0])

        first = asyncio.ensure_future(eng.generate(r(0)))
        await until_running(eng, 1)
        await eng.pause("in_place")
        if commit_between:  # the same weights as version 1: the running row's KV is of version 0
            await eng.stage(1, eng.state_dict_hf())
            await eng.commit(1)
        rest = [asyncio.ensure_future(eng.generate(r(i))) for i in (1, 2, 3)]
        for _ in range(2000):  # until all three wait in the queue (then resume admits them together)
            if eng.health().queued >= 3:
                break
            await asyncio.sleep(0.001)
        assert eng.health().queued == 3, eng.health()
        await eng.resume()
        out = [await first, *[await t for t in rest]]
        return out, int(eng.stats()["shared_prompt_tokens"])
    finally:
        await eng.close()


@pytest.mark.parametrize("routed", [(False, False), (True, True), (False, True)])
async def test_later_samples_copy_a_running_rows_prompt(moe_model: CausalLM, routed: tuple[bool, bool]) -> None:
    shared, n_shared = await late_group(moe_model, True, routed)
    plain, n_plain = await late_group(moe_model, False, routed)
    # the newcomers' leader copies all but the last prompt token from the running row, the
    # other two copy the whole prompt from it; only from a source that recorded routing when
    # they ask for routing
    n = len(PROMPTS[0])
    late = 0 if routed == (False, True) else n - 1
    assert n_shared == late + 2 * n and n_plain == 0
    assert_same(shared, plain)
    assert all(r.cached_tokens == 0 for r in shared)  # sharing is not a session hit


async def test_no_sharing_across_a_weight_commit(dense_model: CausalLM) -> None:
    shared, n_shared = await late_group(dense_model, True, (False, False), commit_between=True)
    plain, _ = await late_group(dense_model, False, (False, False), commit_between=True)
    assert n_shared == 2 * len(PROMPTS[0])  # the newcomers share among themselves, not the old row
    assert_same(shared, plain)


async def test_aborting_the_leader_or_retracting_the_group_keeps_rows_right(dense_model: CausalLM) -> None:
    eng = TorchEngine(dense_model, EngineConfig(max_batch_size=8, max_seq_len=64), batch_invariant=True)
    plain = TorchEngine(dense_model, EngineConfig(max_batch_size=8, max_seq_len=64, share_prompts=False),
                        batch_invariant=True)
    try:
        greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
        alone = await plain.generate(GenerateRequest(input_ids=list(PROMPTS[0]), sampling=greedy))
        group = [GenerateRequest(input_ids=list(PROMPTS[0]), sampling=greedy) for _ in range(4)]
        tasks = [asyncio.ensure_future(eng.generate(r)) for r in group]
        while eng.stats()["generated_tokens"] < 8:
            await asyncio.sleep(0.001)
        assert await eng.abort(group[0].request_id)  # the leader: the followers' rows move, not break
        res = [await t for t in tasks]
        assert res[0].finish_reason == "abort"
        for r in res[1:]:
            assert r.output_ids == alone.output_ids and r.logprobs == alone.logprobs

        tasks = [asyncio.ensure_future(eng.generate(r)) for r in group[:3]]
        while eng.stats()["generated_tokens"] < len(alone.output_ids) * 3 + 12:
            await asyncio.sleep(0.001)
        out = await eng.pause("retract")
        assert len(out) == 3 and all(r.retracted and r.finish_reason == "abort" for r in out)
        await eng.resume()
        part = out[0].output_ids
        rest = SamplingParams(temperature=0.0, max_new_tokens=40 - len(part))
        tail = await eng.generate(GenerateRequest(input_ids=PROMPTS[0] + part, sampling=rest))
        assert part + tail.output_ids == alone.output_ids
    finally:
        await eng.close()
        await plain.close()


@pytest.mark.parametrize("routed", [(False, False), (True, True)])
async def test_prompts_that_begin_alike_share_whole_blocks(moe_model: CausalLM, routed: tuple[bool, bool]) -> None:
    """A running prompt and newcomers with the same 150-token system prompt and their own
    questions: each newcomer copies the 2 common 64-token blocks (128 positions) and
    prefills the rest; one newcomer has the running prompt itself (all but its last token)."""
    g = torch.Generator().manual_seed(1)
    system = torch.randint(0, VOCAB, (150,), generator=g).tolist()
    first = system + [1, 2, 3]
    prompts = (first, system + [4, 5], system[:130] + [6] * 30, list(first))
    shared, n_shared = await late_group(moe_model, True, routed, prompts=prompts)
    plain, _ = await late_group(moe_model, False, routed, prompts=prompts)
    assert n_shared == 128 + 128 + (len(first) - 1)
    assert_same(shared, plain)
    if routed[0]:  # the copied prefix's routing is the newcomer's own, as a full prefill reports it
        for r, p in zip(shared, prompts, strict=True):
            assert r.routed_experts is not None and r.routed_experts.shape[0] == len(p) + len(r.output_ids)
