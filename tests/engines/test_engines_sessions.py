"""Session prefix reuse: turn 2 reuses turn 1's KV, yields the same tokens, LRU eviction under budget."""

from __future__ import annotations

from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.torch_engine import TorchEngine


def req(ids: list[int], key: str | None = None, n: int = 10, seed: int = 3) -> GenerateRequest:
    return GenerateRequest(
        input_ids=ids, session_key=key, sampling=SamplingParams(temperature=0.7, max_new_tokens=n, seed=seed)
    )


async def test_second_turn_reuses_kv_and_matches_no_cache(dense_model) -> None:
    cached = TorchEngine(dense_model, EngineConfig(max_seq_len=256, kv_budget_tokens=1000))
    plain = TorchEngine(dense_model, EngineConfig(max_seq_len=256, kv_budget_tokens=0))
    try:
        prompt = [3, 1, 4, 1, 5, 9, 2, 6]
        t1 = await cached.generate(req(prompt, "s1"))
        assert t1.cached_tokens == 0
        turn2 = prompt + t1.output_ids + [7, 7, 8]
        t2 = await cached.generate(req(turn2, "s1", seed=4))
        ref = await plain.generate(req(turn2, seed=4))
        assert t2.cached_tokens == len(prompt) + len(t1.output_ids)  # flushed: the whole history
        assert t2.output_ids == ref.output_ids
        st = cached.stats()
        assert st["prefix_hit_rate"] > 0 and st["cached_tokens"] == len(turn2) + 10
        # a divergent turn reuses only the common prefix
        t3 = await cached.generate(req(prompt[:4] + [0, 0], "s1"))
        assert t3.cached_tokens == 4
        await cached.end_session("s1")
        assert cached.stats()["cached_sessions"] == 0
    finally:
        await cached.close()
        await plain.close()


async def test_lru_eviction_under_token_budget(dense_model) -> None:
    eng = TorchEngine(dense_model, EngineConfig(max_seq_len=256, kv_budget_tokens=40))
    try:
        for key in ("a", "b", "c"):
            await eng.generate(req([1, 2, 3, 4, 5], key, n=10))  # 15 tokens each
        st = eng.stats()
        assert st["cached_sessions"] == 2 and st["evictions"] == 1 and st["cached_tokens"] == 30
        again = await eng.generate(req([1, 2, 3, 4, 5, 6], "a"))  # 'a' was the LRU victim
        assert again.cached_tokens == 0
        hit = await eng.generate(req([1, 2, 3, 4, 5, 6], "c"))
        assert hit.cached_tokens == 5
    finally:
        await eng.close()
