"""Tolerances for float results that two code paths reach through different summation orders.

Bit-equality holds only where the code guarantees it: the same kernels over the same shapes and
operand layouts (the batch-invariant kernels, a copy, a checkpoint round trip). Two paths that
compute the same math otherwise round differently, and so does one path on another CPU: the
kernels' blocking follows the vector width (`ATEN_CPU_CAPABILITY` default / avx2 / avx512, NEON)
and the thread count. Such comparisons use `assert_reduced_close`, whose tolerance comes from
the dtype and the length of the sums, never from what one machine happened to print.

The bound: a sum of k terms in floating point is off by at most about k * eps * sum(|terms|)
(the classic worst case; rounding errors of random sign give ~ sqrt(k) * eps). A value that
passes through `depth` such reductions in sequence (layers) takes each one's error along. So
rtol = k * depth * eps, and the absolute part is the same fraction of the tensor's largest
magnitude: an element near zero is the difference of large terms and carries their error, not
its own size's. A real bug (a wrong key, a dropped term, a swapped weight) moves results by a
fraction of their magnitude, orders of magnitude above this.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def reduction_tol(dtype: torch.dtype, k: int, depth: int = 1, scale: float = 1.0) -> dict[str, float]:
    """`assert_close` keywords for results of `depth` chained sums of up to `k` terms in `dtype`,
    with `scale` the largest magnitude in play (the absolute part)."""
    tol = torch.finfo(dtype).eps * k * depth
    return {"rtol": tol, "atol": tol * max(scale, 1e-30)}


def assert_reduced_close(actual: torch.Tensor | Sequence[float], expected: torch.Tensor | Sequence[float],
                         k: int, depth: int = 1, dtype: torch.dtype | None = None, what: str = "") -> None:
    """`torch.testing.assert_close` with `reduction_tol` scaled to the largest |expected|; a failure
    shows assert_close's own report (after `what`, when given). Lists of Python floats compare as
    fp32 unless `dtype` says otherwise."""
    a = torch.as_tensor(actual, dtype=dtype or (None if isinstance(actual, torch.Tensor) else torch.float32))
    e = torch.as_tensor(expected, dtype=dtype or (None if isinstance(expected, torch.Tensor) else torch.float32))
    scale = float(e.detach().abs().max()) if e.numel() else 1.0
    torch.testing.assert_close(a, e, **reduction_tol(dtype or e.dtype, k, depth, scale),
                               msg=(lambda report: f"{what}: {report}") if what else None)


def forward_sums(spec: object, tokens: int = 0) -> tuple[int, int]:
    """(k, depth) of a decoder's forward over `tokens` tokens (attention keys, and the sum over
    tokens in a weight's gradient): the widest of its hidden, MLP, expert-MLP, vocabulary
    (log-softmax) and token axes, once per layer and once in the head. Double the depth for
    gradients (the backward runs the chain again)."""
    widths = [getattr(spec, a, 0) or 0 for a in ("hidden_size", "intermediate_size", "moe_intermediate_size",
                                                  "vocab_size")]
    return max(*widths, tokens), int(spec.num_layers)  # type: ignore[attr-defined] + 1
