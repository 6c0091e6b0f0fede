"""One-call flash varlen attention (models/flash_varlen.py): CPU rows keep the per-sequence
loop; on CUDA the fused call equals the loop, forward and gradients."""

from __future__ import annotations

import pytest
import torch

from miles.models import flash_varlen
from miles.models.varlen import PackedSeqs, packed_causal_attention

pytestmark = pytest.mark.timeout(60)


def _row(lens: list[int], dev: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    t = sum(lens)
    q = torch.randn(1, 4, t, 16, generator=g).to(dev, dtype)
    k = torch.randn(1, 2, t, 16, generator=g).to(dev, dtype)
    v = torch.randn(1, 2, t, 16, generator=g).to(dev, dtype)
    return q, k, v


def test_cpu_rows_take_the_loop() -> None:
    q, k, v = _row([3, 5], "cpu", torch.float32)
    seqs = PackedSeqs.of(torch.tensor([0, 3, 8]))
    assert flash_varlen.flash_packed_attention(q, k, v, seqs.bounds, 0.25) is None
    out = packed_causal_attention(q, k, v, seqs, 0.25)
    first = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, :3], k[:, :, :3], v[:, :, :3], is_causal=True, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out[:, :, :3], first)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_flash_varlen_equals_the_loop() -> None:
    lens = [100, 1, 300, 64]
    seqs = PackedSeqs.of(torch.tensor([0, 100, 101, 401, 465]))
    got = {}
    for on in (True, False):
        flash_varlen.ENABLED = on
        q, k, v = (x.requires_grad_(True) for x in _row(lens, "cuda", torch.bfloat16))
        if on:
            assert flash_varlen.flash_packed_attention(q, k, v, seqs.bounds, 0.25) is not None
        out = packed_causal_attention(q, k, v, seqs, 0.25)
        (out.float() * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
        got[on] = [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]
    flash_varlen.ENABLED = True
    for a, b in zip(got[True], got[False], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
