"""The CPU engine's eager decode shortcuts give what the general paths give, bit for bit: rotary
tables read from a per-position table (`Rotary.lookup`), the one-column KV write of rows of one
length (`RowPool.bind_column`, through row views it keeps), the q/k norm weight built once per
weight version (and rebuilt after an update, however it lands), MoE outputs without their
training-only copies, RMSNorm as its own ops, and module forwards called without
`nn.Module.__call__` (whose hooks still fire when registered)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest
import torch

from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.kv_cache import RowPool
from miles.engines.torch_engine import TorchEngine
from miles.models.layers import rms_norm
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


def _decode_step_two_ways(arch: str, seed: int, rows: int, reference: Callable[[], AbstractContextManager[object]]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one decode step after a prefill of `rows` rows of one length: first through the
    engine's shortcuts (inference mode, `bind_column`), then, from the same KV snapshot, through
    the general paths under `reference()` (the indexed `bind`)."""
    model = tiny_model(arch, seed=seed).eval()
    plen = rows + 2
    pool = RowPool(model.spec, rows, 16, torch.float32, torch.device("cpu"))
    prompt = torch.randint(0, VOCAB, (rows, plen), generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(plen).expand(rows, plen)
    with torch.no_grad():
        pool.bind(0, pos, plen)
        mask = cached_causal_mask(torch.zeros(rows, dtype=torch.long), plen, plen)
        model(prompt, pos, attention_mask=mask, kv_cache=pool)
    snapshot = [t.clone() for t in (*pool.k, *pool.v)]
    ids, at = torch.arange(1, rows + 1).unsqueeze(1), torch.full((rows, 1), plen)
    with torch.inference_mode():
        pool.bind_column(0, plen, plen + 1)
        fast = model(ids, at, kv_cache=pool).logits
    for t, s in zip((*pool.k, *pool.v), snapshot, strict=True):
        t.copy_(s)
    with reference():
        pool.bind(0, at, plen + 1)
        ref = model(ids, at, kv_cache=pool).logits
    assert fast is not None and ref is not None
    return fast, ref


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_eager_cpu_decode_equals_the_general_forward(arch: str) -> None:
    """One decode step of rows of one length through the engine's shortcuts (inference mode,
    bind_column) against the same step through the general paths (grad mode off but not
    inference: the indexed KV write, per-call q/k norm weights, MoE copies; the rotary lookup
    is checked against the computed tables above)."""
    fast, ref = _decode_step_two_ways(arch, 3, 3, torch.no_grad)
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


@pytest.mark.parametrize("weight_shape", [(32,), (6, 32)])
def test_rms_norm_without_autograd_equals_f_rms_norm(weight_shape: tuple[int, ...]) -> None:
    """The eager path (no autograd on the CPU: its own six ops) against F.rms_norm (autograd on),
    for a hidden-state norm ([D] weight) and the fused per-head q|k norm ([heads, D] weight)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, 6, 32, generator=g) * 4.0
    w = torch.randn(weight_shape, generator=g).requires_grad_()
    want = rms_norm(x, w, 1e-6)  # autograd on: through F.rms_norm
    assert want.requires_grad
    with torch.inference_mode():
        got = rms_norm(x, w, 1e-6)
    assert torch.equal(got, want.detach())
    assert torch.equal(got, (w * torch.nn.functional.rms_norm(x, (32,), eps=1e-6)).detach())


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_eager_cpu_decode_equals_the_autograd_forward(arch: str) -> None:
    """A decode step without autograd (inference mode: RMSNorm's own ops, forwards called directly,
    the KV write through kept row views) against the same step with autograd on (F.rms_norm,
    `nn.Module.__call__`, the indexed KV write): the same logits, bit for bit."""
    fast, ref = _decode_step_two_ways(arch, 4, 4, torch.enable_grad)
    assert ref.requires_grad
    assert torch.equal(fast, ref.detach())


def test_decode_forward_hooks_still_fire() -> None:
    """With a forward hook on a layer (or on its attention), the eager step calls the module,
    so the hook runs (and may change the output) as it would under autograd."""
    model = tiny_model("qwen3", seed=5).eval()
    pool = RowPool(model.spec, 2, 8, torch.float32, torch.device("cpu"))
    calls: list[str] = []
    layer = model.model.layers[1]
    h1 = layer.register_forward_hook(lambda m, a, out: calls.append("layer"))
    h2 = layer.self_attn.register_forward_hook(lambda m, a, out: calls.append("attn") or out * 0.0)
    ids, at = torch.tensor([[1], [2]]), torch.zeros(2, 1, dtype=torch.long)
    with torch.inference_mode():
        pool.bind_column(0, 0, 1)
        hooked = model(ids, at, kv_cache=pool).logits
        h1.remove()
        h2.remove()
        pool.bind_column(0, 0, 1)
        plain = model(ids, at, kv_cache=pool).logits
    assert calls == ["attn", "layer"]
    assert not torch.equal(hooked, plain)  # the attention hook's zeroed output took effect


def test_bind_column_follows_its_rows() -> None:
    """The row views `bind_column` keeps follow the rows each step covers: steps over rows 0..2,
    then 1..2 (a finished row 0), then 0..1 leave what the indexed writes of `bind` leave."""
    spec = tiny_model("qwen3").spec
    pools = [RowPool(spec, 3, 8, torch.float32, torch.device("cpu")) for _ in range(2)]
    heads, _, dim = spec.kv_cache_dims_at(0)
    g = torch.Generator().manual_seed(2)
    for r0, n, col in ((0, 3, 2), (1, 2, 3), (0, 2, 4)):
        k, v = torch.randn(n, heads, 1, dim, generator=g), torch.randn(n, heads, 1, dim, generator=g)
        pools[0].bind(r0, torch.full((n, 1), col), col + 1)
        pools[1].bind_column(r0, col, col + 1)
        with torch.inference_mode():
            outs = [p.update(0, k, v) for p in pools]
        for a, b in zip(*outs, strict=True):
            assert a.shape == (n, heads, col + 1, dim) and torch.equal(a, b)
    for a, b in zip((pools[0].k[0], pools[0].v[0]), (pools[1].k[0], pools[1].v[0]), strict=True):
        assert torch.equal(a, b)
