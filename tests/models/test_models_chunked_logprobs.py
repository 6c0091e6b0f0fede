"""The chunked LM-head logprobs (models/chunked_logprobs.py) equal the unfused path
(logits -> token_logprobs / entropy_from_logits) within fp32 rounding, values and gradients,
and the trainer's packed forward gives the same logprobs, entropy and gradients either way."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numerics import assert_reduced_close

from miles.models import chunked_logprobs as ch
from miles.models.config import ModelSpec
from miles.models.errors import ModelInputError
from miles.models.logprobs import token_logprobs
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.batch import TrainSample
from miles.trainer.forward import packed_forward
from miles.trainer.kl import entropy_from_logits
from miles.trainer.packing import pack

pytestmark = pytest.mark.timeout(60)


def _unfused(h: torch.Tensor, w: torch.Tensor, tgt: torch.Tensor, temp: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = h @ w.t()
    return token_logprobs(logits, tgt, temp), entropy_from_logits(logits, temp if temp > 0 else 1.0)


@pytest.mark.parametrize(("temp", "chunk_elems", "save_bytes"), [
    (1.0, 7 * 50, 1 << 30),  # 7 tokens a chunk, logits kept for backward
    (0.7, 5 * 50, 0),  # recomputed in backward
    (0.0, 1 << 28, 1 << 30),  # greedy counts as 1; one chunk
])
def test_chunked_head_equals_unfused_values_and_grads(
    monkeypatch: pytest.MonkeyPatch, temp: float, chunk_elems: int, save_bytes: int
) -> None:
    monkeypatch.setattr(ch, "CHUNK_ELEMS", chunk_elems)
    monkeypatch.setattr(ch, "SAVE_LOGITS_BYTES", save_bytes)
    g = torch.Generator().manual_seed(0)
    m, hdim, v = 23, 16, 50
    h0 = torch.randn(m, hdim, generator=g) * 2
    w0 = torch.randn(v, hdim, generator=g)
    tgt = torch.randint(0, v, (m,), generator=g)
    c_lp, c_ent = torch.randn(m, generator=g), torch.randn(m, generator=g)
    out = {}
    for name in ("fused", "unfused"):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        if name == "fused":
            lp, ent = ch.chunked_head_logprobs(h, w, tgt, temp, entropy=True)
            assert ent is not None
        else:
            lp, ent = _unfused(h, w, tgt, temp)
        ((lp * c_lp).sum() + (ent * c_ent).sum()).backward()
        out[name] = (lp.detach(), ent.detach(), h.grad, w.grad)
    for a, b in zip(out["fused"], out["unfused"], strict=True):  # logp, entropy, grad h, grad w
        assert_reduced_close(a, b, k=v, depth=2)  # sums over the vocabulary, forward and backward


def test_chunked_head_without_entropy_and_logp_only_grads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ch, "CHUNK_ELEMS", 4 * 30)
    g = torch.Generator().manual_seed(1)
    h0, w0 = torch.randn(9, 8, generator=g), torch.randn(30, 8, generator=g)
    tgt = torch.randint(0, 30, (9,), generator=g)
    h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    lp, ent = ch.chunked_head_logprobs(h, w, tgt, 1.3)
    assert ent is None
    lp.sum().backward()
    h2, w2 = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    token_logprobs(h2 @ w2.t(), tgt, 1.3).sum().backward()
    assert_reduced_close(lp, token_logprobs(h0 @ w0.t(), tgt, 1.3), k=30)
    assert_reduced_close(h.grad, h2.grad, k=30, depth=2)
    assert_reduced_close(w.grad, w2.grad, k=30, depth=2)


def test_entropy_computed_but_unused_gives_logp_only_grads() -> None:
    """The trainer always asks for the entropy (a metric); with entropy_coef 0 the loss does not
    use it, and its backward term is skipped (no gradient arrives for it)."""
    g = torch.Generator().manual_seed(2)
    h0, w0 = torch.randn(11, 8, generator=g), torch.randn(30, 8, generator=g)
    tgt = torch.randint(0, 30, (11,), generator=g)
    h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    lp, ent = ch.chunked_head_logprobs(h, w, tgt, 1.0, entropy=True)
    assert ent is not None and ent.requires_grad
    (lp * torch.arange(11.0)).sum().backward()
    h2, w2 = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    (token_logprobs(h2 @ w2.t(), tgt) * torch.arange(11.0)).sum().backward()
    assert_reduced_close(h.grad, h2.grad, k=30, depth=2)
    assert_reduced_close(w.grad, w2.grad, k=30, depth=2)


def _samples(spec: ModelSpec, n: int, seed: int) -> list[TrainSample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(2, 7)), int(rng.integers(1, 8))
        out.append(TrainSample(
            prompt_ids=rng.integers(0, spec.vocab_size, p), response_ids=rng.integers(0, spec.vocab_size, r),
            reward=1.0, group_index=i, rollout_logprobs=np.zeros(r, np.float32),
        ))
    return out


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_packed_forward_fused_head_equals_unfused(arch: str) -> None:
    """The trainer's forward: logprobs, entropy and every parameter's gradient agree."""
    model = build_model(ModelSpec.from_hf(tiny_config(arch, vocab_size=96, initializer_range=0.2)), seed=2)
    samples = _samples(model.spec, 5, seed=3)
    mb = pack(samples, list(range(5)))
    weights = torch.linspace(-1, 1, mb.resp_targets.numel())
    out = {}
    for fused in (True, False):
        model.zero_grad()
        fo = packed_forward(model, mb, temperature=0.8, replay=False, with_entropy=True, fused_head=fused)
        assert (fo.logits is None) == fused and fo.entropy is not None
        ((fo.logp * weights).sum() + 0.1 * (fo.entropy * weights).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out[fused] = (fo.logp.detach(), fo.entropy.detach(), grads)
    # Fused and unfused heads sum the vocabulary in other orders, and a gradient also sums over
    # the packed tokens: fp32 rounding of the widest such sum, through every layer and back.
    sp = model.spec
    k = max(sp.hidden_size, sp.intermediate_size, sp.vocab_size, mb.resp_targets.numel())
    depth = sp.num_layers + 1
    assert_reduced_close(out[True][0], out[False][0], k=k, depth=depth)
    assert_reduced_close(out[True][1], out[False][1], k=k, depth=depth)
    assert out[True][2].keys() == out[False][2].keys()
    for n, g in out[False][2].items():
        assert_reduced_close(out[True][2][n], g, k=k, depth=2 * depth, what=n)  # forward and backward


def test_target_ids_shape_is_checked() -> None:
    model = build_model(ModelSpec.from_hf(tiny_config("qwen3", vocab_size=32)), seed=0)
    ids = torch.zeros(1, 5, dtype=torch.long)
    with pytest.raises(ModelInputError, match="target_ids must be"):
        model(ids, logits_index=torch.tensor([0, 1]), target_ids=torch.zeros(3, dtype=torch.long))
    out = model(ids, target_ids=torch.zeros(5, dtype=torch.long))
    assert out.logits is None and out.logprobs is not None and out.logprobs.shape == (5,)


def test_compiled_head_ops_equal_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-chunk math through dynamo (eager backend: the wiring and graphs; inductor's
    kernels are checked on the GPU by the bench), two chunk sizes, with entropy."""
    monkeypatch.setattr(ch, "CHUNK_ELEMS", 6 * 40)
    g = torch.Generator().manual_seed(4)
    h0, w0 = torch.randn(15, 8, generator=g), torch.randn(40, 8, generator=g)
    tgt = torch.randint(0, 40, (15,), generator=g)
    out = []
    for ops in (ch.EAGER, ch.compiled_head_ops("eager")):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        lp, ent = ch.chunked_head_logprobs(h, w, tgt, 0.9, entropy=True, ops=ops)
        assert ent is not None
        (lp.sum() + 0.5 * ent.sum()).backward()
        out.append((lp.detach(), ent.detach(), h.grad, w.grad))
    for a, b in zip(*out, strict=True):
        assert_reduced_close(a, b, k=40, depth=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_chunked_head_matches_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ch, "CHUNK_ELEMS", 300 * 5000)
    g = torch.Generator().manual_seed(5)
    h0 = torch.randn(700, 64, generator=g).to("cuda", torch.bfloat16)
    w0 = (torch.randn(5000, 64, generator=g) * 0.1).to("cuda", torch.bfloat16)
    tgt = torch.randint(0, 5000, (700,), generator=g).to("cuda")
    out = []
    for fused in (True, False):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        lp, ent = ch.chunked_head_logprobs(h, w, tgt, 0.8, entropy=True) if fused else _unfused(h, w, tgt, 0.8)
        assert ent is not None
        (lp.sum() + ent.sum()).backward()
        out.append((lp.detach(), ent.detach(), h.grad.float(), w.grad.float()))
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))
