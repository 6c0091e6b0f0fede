"""The Triton batch-invariant kernels (models/invariant_triton.py), on CUDA: accuracy against
torch's ops, and a row's bits independent of the rows beside it (decode row over a KV cache
vs the same row inside a training sequence)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernels)"),
]


@pytest.fixture(scope="module")
def kernels():  # type: ignore[no-untyped-def]
    from miles.models import invariant_triton

    return invariant_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_do_not_depend_on_the_batch(kernels, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 896, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(1000, 896, device="cuda", dtype=dtype, generator=g) * 0.05
    full = kernels.invariant_linear(x, w, None)
    ref = F.linear(x.double(), w.double())
    assert (full.double() - ref).abs().max().item() < (1e-3 if dtype == torch.float32 else 0.5)
    for s, n in ((0, 1), (17, 5), (64, 64), (299, 1)):
        assert torch.equal(kernels.invariant_linear(x[s : s + n], w, None), full[s : s + n])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "d", "dv"), [(8, 2, 64, 64), (4, 4, 192, 128)])
def test_attention_decode_row_equals_training_row(kernels, dtype: torch.dtype, heads: int, kv_heads: int,  # type: ignore[no-untyped-def]
                                                   d: int, dv: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    t, cap = 150, 256
    q = torch.randn(1, heads, t, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(1, kv_heads, t, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(1, kv_heads, t, dv, device="cuda", dtype=dtype, generator=g)
    train = kernels.invariant_attention(q, k, v, None, True, None)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                         enable_gqa=heads != kv_heads)
    assert (train.double() - ref).abs().max().item() < (1e-4 if dtype == torch.float32 else 0.05)
    kc = torch.zeros(1, kv_heads, cap, d, device="cuda", dtype=dtype)
    vc = torch.zeros(1, kv_heads, cap, dv, device="cuda", dtype=dtype)
    kc[:, :, :t], vc[:, :, :t] = k, v
    for p in (0, 15, 16, 63, 64, 149):
        mask = torch.zeros(1, 1, 1, cap, dtype=torch.bool, device="cuda")
        mask[..., : p + 1] = True
        row = kernels.invariant_attention(q[:, :, p : p + 1], kc, vc, mask, False, None)
        assert torch.equal(row[:, :, 0], train[:, :, p]), p


def test_attention_gradients_match_sdpa(kernels) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(2, 4, 40, 64, device="cuda", generator=g, requires_grad=True) for _ in range(3))
    kernels.invariant_attention(q, k, v, None, True, None).square().sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum().backward()
    for a, x in zip(grads, (q, k, v), strict=True):
        assert torch.allclose(a, x.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_rows_do_not_depend_on_the_batch(kernels, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator(device="cuda").manual_seed(3)
    e, h, i, n, k = 16, 256, 128, 300, 4
    gate_up = torch.randn(e, 2 * i, h, device="cuda", dtype=dtype, generator=g) * 0.05
    down = torch.randn(e, h, i, device="cuda", dtype=dtype, generator=g) * 0.05
    x = torch.randn(n, h, device="cuda", dtype=dtype, generator=g)
    ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, device="cuda", generator=g)
    full = kernels.invariant_experts(x, ids, w, gate_up, down, i)
    ref = torch.zeros(n, h, device="cuda", dtype=torch.float64)
    for j in range(k):  # per-slot dense reference in float64
        gu = torch.einsum("nh,nih->ni", x.double(), gate_up[ids[:, j]].double())
        act = F.silu(gu[:, :i]) * gu[:, i:]
        ref += w[:, j : j + 1].double() * torch.einsum("ni,nhi->nh", act, down[ids[:, j]].double())
    assert (full.double() - ref).abs().max().item() < (1e-4 if dtype == torch.float32 else 0.05)
    for s, m in ((0, 1), (5, 7), (100, 64)):
        assert torch.equal(kernels.invariant_experts(x[s : s + m], ids[s : s + m], w[s : s + m], gate_up, down, i),
                           full[s : s + m])
