"""The CPU engine's eager decode shortcuts give what the general paths give, bit for bit: rotary
tables read from a per-position table (`Rotary.lookup`), the one-column KV write of rows of one
length (`RowPool.bind_column`), the q/k norm weight built once per weight version (and rebuilt
after an update, however it lands), and MoE outputs without their training-only copies."""

from __future__ import annotations

import pytest
import torch

from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.kv_cache import RowPool
from miles.engines.torch_engine import TorchEngine
from miles.models.masks import cached_causal_mask
from miles.models.rope import rotary_tables

from .conftest import VOCAB, tiny_model

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("rope", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}])
def test_rotary_lookup_equals_the_computed_tables(rope: dict | None) -> None:
    kw = {"rope_scaling": rope} if rope else {}
    rotary = tiny_model("qwen3", **kw).model.rotary
    pos = torch.tensor([[0], [5], [255], [3]])
    got = rotary.lookup(pos, torch.float32)
    for g, w in zip(got, rotary_tables(*rotary(pos, torch.float32)), strict=True):
        assert torch.equal(g, w)
    far = torch.tensor([[300, 301], [1000, 1001]])  # past the first table: it grows
    got = rotary.lookup(far, torch.float32)
    assert rotary._table is not None and rotary._table[2].shape[0] == 1024
    for g, w in zip(got, rotary_tables(*rotary(far, torch.float32)), strict=True):
        assert torch.equal(g, w)
    neg = torch.tensor([[-2], [3]])  # not read from the table (a negative index would wrap around)
    for g, w in zip(rotary.lookup(neg, torch.float32), rotary_tables(*rotary(neg, torch.float32)), strict=True):
        assert torch.equal(g, w)
    rotary.to(torch.float64)  # a cast drops the table (its dtype is part of the key anyway)
    assert rotary._table is None


def test_bind_column_writes_what_bind_writes() -> None:
    spec = tiny_model("qwen3").spec
    pools = [RowPool(spec, 4, 32, torch.float32, torch.device("cpu")) for _ in range(2)]
    heads, _, dim = spec.kv_cache_dims_at(0)
    k, v = torch.randn(3, heads, 1, dim), torch.randn(3, heads, 1, dim)
    pools[0].bind(1, torch.full((3, 1), 7), 8)
    pools[1].bind_column(1, 7, 8)
    outs = [p.update(0, k, v) for p in pools]
    for a, b in zip(*outs, strict=True):
        assert a.shape == (3, heads, 8, dim) and torch.equal(a, b)
    for a, b in zip((pools[0].k[0], pools[0].v[0]), (pools[1].k[0], pools[1].v[0]), strict=True):
        assert torch.equal(a, b) and a[1:4, :, 7].abs().sum() > 0
    pools[1].bind(0, torch.full((3, 1), 2), 3)  # a later bind writes by index again
    pools[1].update(0, k, v)
    assert torch.equal(pools[1].k[0][0:3, :, 2:3], k)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_eager_cpu_decode_equals_the_general_forward(arch: str) -> None:
    """One decode step of rows of one length through the engine's shortcuts (inference mode,
    bind_column) against the same step through the general paths (grad mode off but not
    inference: the indexed KV write, per-call q/k norm weights, MoE copies; the rotary lookup
    is checked against the computed tables above)."""
    model = tiny_model(arch, seed=3).eval()
    pool = RowPool(model.spec, 3, 16, torch.float32, torch.device("cpu"))
    prompt = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(5).expand(3, 5)
    with torch.inference_mode():
        pool.bind(0, pos, 5)
        model(prompt, pos, attention_mask=cached_causal_mask(torch.zeros(3, dtype=torch.long), 5, 5), kv_cache=pool)
        snapshot = [t.clone() for t in (*pool.k, *pool.v)]
        ids, at = torch.tensor([[1], [2], [3]]), torch.full((3, 1), 5)
        pool.bind_column(0, 5, 6)
        fast = model(ids, at, kv_cache=pool).logits
    for t, s in zip((*pool.k, *pool.v), snapshot, strict=True):
        t.copy_(s)
    with torch.no_grad():  # not inference mode: no cached q/k norm weight, MoE outputs copied
        pool.bind(0, at, 6)
        ref = model(ids, at, kv_cache=pool).logits
    assert torch.equal(fast, ref)


async def test_qk_norm_weight_follows_weight_updates() -> None:
    """Greedy tokens after a commit that changes only the q/k norm weights equal those of a fresh
    engine holding the new weights: the cached per-head weight is rebuilt, not reused."""
    def req() -> GenerateRequest:
        return GenerateRequest(input_ids=[5, 6, 7, 8], sampling=SamplingParams(temperature=0.0, max_new_tokens=12))

    cfg = EngineConfig(max_batch_size=2, max_seq_len=64, kv_budget_tokens=0)
    model = tiny_model("qwen3", seed=1)
    eng = TorchEngine(model, cfg)
    try:
        before = (await eng.generate(req())).output_ids
        new = eng.state_dict_hf()  # a full version in which only the q/k norm weights change
        norms = [t for k, t in new.items() if k.endswith(("q_norm.weight", "k_norm.weight"))]
        assert norms
        for t in norms:
            t.mul_(-3.0)
        await eng.stage(1, new)
        await eng.commit(1)
        after = (await eng.generate(req())).output_ids
    finally:
        await eng.close()
    fresh_model = tiny_model("qwen3", seed=1)
    with torch.no_grad():
        for name, p in fresh_model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(-3.0)
    fresh = TorchEngine(fresh_model, cfg)
    try:
        want = (await fresh.generate(req())).output_ids
    finally:
        await fresh.close()
    assert after == want and after != before
