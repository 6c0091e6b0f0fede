"""Batch-invariant execution of the shared model code, for true on-policy RL.

Inside `BatchInvariant()` a token's logits no longer depend on how many other rows or
sequences share the forward, so the engine (decoding a changing batch over a KV cache)
and the trainer (one full sequence per forward) compute bit-identical logprobs with the
same `CausalLM` code. It is a `TorchFunctionMode` that swaps three ops:

- `F.linear` and `x @ W` with a 2-D W: the rows are cut into fixed tiles of `row_block`
  rows (the last zero-padded), one GEMM per tile, so every GEMM has one shape and a row's
  reduction order cannot depend on the batch size (BLAS picks kernels, and split-K, by
  shape).
- `F.scaled_dot_product_attention`: an explicit softmax attention per (batch row, head)
  whose key axis is zero-padded to a multiple of `kv_block` (padded keys masked with
  -inf), scores and weighted sums through the tiled GEMM above. Keys must sit at the
  same positions on both sides (position p of a sequence at key slot p): the trainer runs
  one unpacked sequence per forward, and the engine's KV rows start at slot 0.

Everything else in the model is per-row already (elementwise ops, RMSNorm and softmax
over the last axis). MoE experts ask `invariant_active()` and then take a dispatch whose
path does not depend on the token count (`Experts._invariant`). The mode is thread-local:
enter it in the thread that runs the forward.

dtypes: both sides must run the same dtypes at every op. The tiles compute in the input
dtype; attention scores come out in q's dtype and the softmax runs in fp32; RMSNorm
statistics and the rotary tables are fp32 (`Rotary` keeps its frequencies fp32 when the
model is cast). So a bf16 engine (`model.to(bfloat16)`) and a bf16 trainer (fp32 masters
cast per forward by FSDP mixed precision) agree bit for bit, as in fp32.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def tiled_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int
) -> torch.Tensor:
    """F.linear with every GEMM of shape [rows, K] x [K, N]: batch-size invariant per row."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    pad = (-m) % rows
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, k)])
    tiles = [F.linear(x2[i : i + rows], weight) for i in range(0, x2.shape[0], rows)]
    if pad:  # cut the padding before the cat, so the result is not a view of a larger tensor
        tiles[-1] = tiles[-1][: rows - pad]
    out = torch.cat(tiles)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


def invariant_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    rows: int,
    kv_block: int,
) -> torch.Tensor:
    """q [B, Hq, T, d], k [B, Hk, S, d], v [B, Hk, S, dv] -> [B, Hq, T, dv] with a fixed
    reduction layout."""
    b, hq, t, d = q.shape
    s = k.shape[2]
    if enable_gqa and k.shape[1] != hq:
        k = k.repeat_interleave(hq // k.shape[1], dim=1)
        v = v.repeat_interleave(hq // v.shape[1], dim=1)
    length = -(-s // kv_block) * kv_block
    heads = attn_mask.shape[1] if attn_mask is not None and attn_mask.dim() == 4 else 1
    bias = torch.zeros(b, heads, t, length, dtype=q.dtype, device=q.device)
    bias[..., s:] = float("-inf")
    if is_causal:
        qi = torch.arange(t, device=q.device)[:, None] + (s - t)
        kj = torch.arange(s, device=q.device)[None, :]
        bias[..., :s] = bias[..., :s].masked_fill(kj > qi, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias[..., :s] = bias[..., :s].masked_fill(~attn_mask, float("-inf"))
        else:
            bias[..., :s] = bias[..., :s] + attn_mask
    scale = d**-0.5 if scale is None else scale
    kp = F.pad(k, (0, 0, 0, length - s))
    vp = F.pad(v, (0, 0, 0, length - s))
    out = q.new_empty(b, hq, t, v.shape[-1])  # MLA: values narrower than queries/keys
    for i in range(b):
        for h in range(hq):  # a mask may be per head (attention sinks) or shared
            mb = bias[i if bias.shape[0] > 1 else 0, h if bias.shape[1] > 1 else 0]
            scores = tiled_linear(q[i, h], kp[i, h], None, rows) * scale + mb
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            out[i, h] = tiled_linear(probs, vp[i, h].t().contiguous(), None, rows)
    return out


@functools.cache
def triton_kernels() -> ModuleType | None:
    """`models/invariant_triton.py` where Triton imports (CUDA torch), else None."""
    try:
        from miles.models import invariant_triton
    except ImportError:
        return None
    return invariant_triton


def _on_cuda(*ts: object) -> ModuleType | None:
    """The Triton kernels when every tensor argument is on CUDA (one launch per op instead of
    the tiled path's launch per tile and per head)."""
    if all(not isinstance(t, torch.Tensor) or t.is_cuda for t in ts):
        return triton_kernels()
    return None


_state = threading.local()


def invariant_active() -> bool:
    """True inside `BatchInvariant()` in this thread."""
    return getattr(_state, "depth", 0) > 0


class BatchInvariant(TorchFunctionMode):
    """Context manager: batch-invariant linear / matmul / attention (see module docstring)."""

    def __init__(self, row_block: int = 16, kv_block: int = 256) -> None:
        super().__init__()
        self.rows = row_block
        self.kv_block = kv_block

    def __enter__(self) -> BatchInvariant:
        _state.depth = getattr(_state, "depth", 0) + 1
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        _state.depth -= 1
        super().__exit__(*exc)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (kernels := _on_cuda(x, w, bias)) is not None:
                return kernels.invariant_linear(x, w, bias)
            return tiled_linear(x, w, bias, self.rows)
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
            x, w = args[0], args[1]
            if isinstance(w, torch.Tensor) and w.dim() == 2 and x.dim() >= 2:
                if (kernels := _on_cuda(x, w)) is not None:
                    return kernels.invariant_linear(x, w.t(), None)
                return tiled_linear(x, w.t(), None, self.rows)
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
            a = dict(zip(names, args, strict=False)) | kwargs
            if a.get("dropout_p", 0.0):
                raise ValueError("batch-invariant attention does not support dropout")
            if (kernels := _on_cuda(a["query"], a["key"], a["value"], a.get("attn_mask"))) is not None:
                return kernels.invariant_attention(a["query"], a["key"], a["value"], a.get("attn_mask"),
                                                   bool(a.get("is_causal", False)), a.get("scale"))
            return invariant_attention(
                a["query"],
                a["key"],
                a["value"],
                a.get("attn_mask"),
                bool(a.get("is_causal", False)),
                a.get("scale"),
                bool(a.get("enable_gqa", False)),
                self.rows,
                self.kv_block,
            )
        return func(*args, **kwargs)
