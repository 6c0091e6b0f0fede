"""Masked attention off cuDNN's backward (models/masked_sdpa.py): on Hopper with torch >= 2.11,
cuDNN's masked SDPA backward returns NaN in dq when the key length is 64 past a multiple of 128
and a row's logsumexp is below ln(FLT_MAX); Qwen2.5's heads whose scores all sit near -100 hit it.
The GPU test builds such a row and checks that `masked_sdpa` differentiates it finitely and
agrees with the math kernel; the CPU test checks the call is SDPA's own off CUDA."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from miles.models.masked_sdpa import masked_sdpa, needs_no_cudnn

pytestmark = pytest.mark.timeout(60)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _low_scores(n: int, d: int, dev: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v [1, 2, n, d] whose every score q.k / sqrt(d) is about -110 (logsumexp << -88.7)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, n, d, generator=g) * 0.05
    k = torch.randn(1, 2, n, d, generator=g) * 0.05
    v = torch.randn(1, 2, n, d, generator=g)
    q[..., 1] = 1.0
    k[..., 1] = -110.0 * d**0.5
    # through bf16 first: an fp32 reference then sees exactly the bf16 run's inputs
    return tuple(x.to(torch.bfloat16).to(dev, dtype).requires_grad_(True) for x in (q, k, v))


def _grads(fn: Attend, n: int, d: int, dev: str, dtype: torch.dtype) -> list[torch.Tensor]:
    q, k, v = _low_scores(n, d, dev, dtype)
    mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril()[None, None]
    out = fn(q, k, v, mask)
    w = torch.linspace(-1, 1, out.numel(), device=dev).view_as(out)
    (out.float() * w).sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]


def test_cpu_is_sdpas_own_call() -> None:
    assert not needs_no_cudnn(torch.zeros(1))
    n, d = 80, 16
    ours = _grads(lambda q, k, v, m: masked_sdpa(q, k, v, m, d**-0.5), n, d, "cpu", torch.float32)
    plain = _grads(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=d**-0.5),
                   n, d, "cpu", torch.float32)
    for a, b in zip(ours, plain, strict=True):
        assert torch.equal(a, b)
    assert all(torch.isfinite(t).all() for t in ours)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n", [704, 2880])  # both 64 past a multiple of 128 (2,880: session 16's micro-batch)
def test_cuda_masked_backward_is_finite_and_matches_math(n: int) -> None:
    d = 64
    ours = _grads(lambda q, k, v, m: masked_sdpa(q, k, v, m, d**-0.5), n, d, "cuda", torch.bfloat16)
    assert all(torch.isfinite(t).all() for t in ours), "masked attention gave a non-finite gradient"

    def math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=d**-0.5)

    # the reference: the math kernel in fp32 (in bf16 it is itself off by more than the efficient kernel)
    ref = _grads(math, n, d, "cuda", torch.float32)
    # what torch's own choice gives on this card (the bug's witness; not asserted: a fixed torch is clean)
    plain = _grads(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=d**-0.5),
                   n, d, "cuda", torch.bfloat16)
    # dq's channel 1 is -110 sqrt(d) times a sum that is 0 exactly (softmax's gradient sums to 0 over
    # keys): pure cancellation noise in bf16, so it is left out of the comparison
    keep = torch.ones(d, dtype=torch.bool, device="cuda")
    keep[1] = False
    ours[1], ref[1] = ours[1][..., keep], ref[1][..., keep]
    rel = [((a - b).norm() / b.norm()).item() for a, b in zip(ours, ref, strict=True)]
    print(f"n={n} default-backend dq non-finite: {int((~torch.isfinite(plain[1])).sum())}; "
          f"ours vs fp32 math, relative error of out, dq, dk, dv: {[f'{r:.2g}' for r in rel]}")
    assert max(rel) < 2e-2, rel
