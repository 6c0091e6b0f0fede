"""Packed causal attention as ONE flash-attention call over the whole row (CUDA, bf16/fp16).

`models/varlen.py` runs one SDPA call per sequence: a 16k-token pack of 1k-token sequences is
16 small kernels per layer (x3 in backward), each filling a fraction of the GPU. Torch's
`torch.nn.attention.varlen.varlen_attn` takes the row with its cumulative sequence offsets and
runs the flash varlen kernel once (forward and backward). Its signature changed across torch
releases (`is_causal` in early ones; `window_size`, `scale`, `enable_gqa` later), so the call
is built from the signature; where a feature is missing, GQA repeats the key/value heads and a
non-default scale falls back to the per-sequence loop. `ENABLED` switches the path (benches).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import structlog
import torch

from miles.models.invariant import invariant_active

ENABLED = True


@functools.cache
def _api() -> tuple[Callable[..., Any], frozenset[str]] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


@functools.lru_cache(maxsize=16)
def _cu(bounds: tuple[tuple[int, int], ...], device: torch.device) -> tuple[torch.Tensor, int]:
    """Device offsets [n+1] int32 and the longest sequence, once per packed row and device."""
    cu = [bounds[0][0]] + [b for _, b in bounds]
    return torch.tensor(cu, dtype=torch.int32, device=device), max(b - a for a, b in bounds)


def flash_packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: tuple[tuple[int, int], ...], scale: float
) -> torch.Tensor | None:
    """q [1, heads, T, d], k and v [1, kv_heads, T, d] -> [1, heads, T, d] causal within each
    sequence, or None where this path does not apply (the caller loops instead)."""
    api = _api()
    t, d = q.shape[2], q.shape[3]
    if (
        not ENABLED
        or invariant_active()  # batch-invariant mode attends per sequence through its own kernel
        or api is None
        or not q.is_cuda
        or q.dtype not in (torch.bfloat16, torch.float16)
        or not bounds
        or bounds[0][0] != 0
        or bounds[-1][1] != t
        or any(a[1] != b[0] for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    ):
        return None
    fn, params = api
    kw: dict[str, Any] = {}
    if "scale" in params:
        kw["scale"] = scale
    elif abs(scale - d**-0.5) > 1e-12 * scale:
        return None
    heads, kv_heads = q.shape[1], k.shape[1]
    qt, kt, vt = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)  # [T, h, d]
    if kv_heads != heads:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:  # query head h reads kv head h // (heads / kv_heads), as SDPA's enable_gqa
            kt = kt.repeat_interleave(heads // kv_heads, dim=1)
            vt = vt.repeat_interleave(heads // kv_heads, dim=1)
    if "window_size" in params:
        kw["window_size"] = (-1, 0)
    else:
        kw["is_causal"] = True
    cu, longest = _cu(bounds, q.device)
    try:
        out = fn(qt, kt, vt, cu, cu, longest, longest, **kw)
    except (RuntimeError, TypeError, ValueError) as exc:  # a build or GPU without the kernel
        _disable(exc)
        return None
    return out.transpose(0, 1).unsqueeze(0)


def _disable(exc: BaseException) -> None:
    global ENABLED
    ENABLED = False
    structlog.get_logger().warning("flash_varlen_unavailable", error=repr(exc), fallback="per-sequence SDPA")
