"""Batch-invariant GEMM and attention as single Triton kernels (CUDA), for true on-policy RL.

`models/invariant.py` makes a row's result independent of the batch by cutting every GEMM
into fixed 16-row tiles and running attention per (row, head) in Python: exact, but one
launch per tile and per head. These kernels get the same property by construction, in one
launch per op:

- `invariant_linear`: every output element accumulates its K reduction in BLOCK_K steps, in
  order, inside one program, with no split-K. Tile sizes are constants, so the compiled
  kernel and each element's instruction sequence are the same whatever M is; M is not
  specialised on (`do_not_specialize`), so M = 1 and M = 8192 run the same binary.
- `invariant_attention`: flash-style online softmax over key blocks of BLOCK_N, starting at
  key slot 0, in order. A query row visits the same key blocks with the same values whether
  it sits in a decode step (one row over a KV cache) or in a training sequence (all rows):
  the blocks after its last visible key are fully masked and leave the state bit for bit
  unchanged (scale 1, add 0), so a different loop end does not change the result.

Backward passes are not invariant and need not be: gradients go through torch's own ops
(a recomputed SDPA for attention), which compute the same function.

Needs `triton` (shipped with CUDA torch); never imported on CPU-only installs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# fixed tiles: part of the numerical contract (engine and trainer must run the same ones)
LIN_BLOCK_M, LIN_BLOCK_N, LIN_BLOCK_K = 64, 64, 64
ATT_BLOCK_M, ATT_BLOCK_N = 16, 64


@triton.jit
def _tile_dot(x_ptr, w_ptr, rm, rn, rows, N, K, sxm, sxk, swn, swk,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """x[rm, :] @ w[rn, :].T for one BM x BN tile, over K in fixed BK steps in order (the
    reduction order is the numerical contract); `rows` masks the tile's rows. Both GEMM kernels
    (plain and grouped by expert) run this same loop."""
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk, mask=rows & (kk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk,
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    return acc


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, o_ptr, M, N, K, sxm, sxk, swn, swk, som, son,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rows = rm[:, None] < M
    acc = _tile_dot(x_ptr, w_ptr, rm, rn, rows, N, K, sxm, sxk, swn, swk, BM, BN, BK, IEEE)
    tl.store(o_ptr + rm[:, None] * som + rn[None, :] * son, acc.to(o_ptr.dtype.element_ty),
             mask=rows & (rn[None, :] < N))


def _linear_fwd(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    m, k = x2.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, LIN_BLOCK_M), triton.cdiv(n, LIN_BLOCK_N))
    _linear_kernel[grid](x2, w, out, m, n, k, x2.stride(0), x2.stride(1), w.stride(0), w.stride(1),
                         out.stride(0), out.stride(1), BM=LIN_BLOCK_M, BN=LIN_BLOCK_N, BK=LIN_BLOCK_K,
                         IEEE=x2.dtype == torch.float32)
    return out


class _InvariantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x2, w)
        return _linear_fwd(x2, w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x2, w = ctx.saved_tensors
        gx = grad @ w if ctx.needs_input_grad[0] else None
        gw = grad.t() @ x2 if ctx.needs_input_grad[1] else None
        return gx, gw


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear whose every output row is computed the same way for any number of rows."""
    if weight.dtype != x.dtype:
        raise TypeError(f"invariant_linear: input {x.dtype} and weight {weight.dtype} differ")
    lead, k = x.shape[:-1], x.shape[-1]
    out = _InvariantLinear.apply(x.reshape(-1, k), weight)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


@triton.jit(do_not_specialize=["T", "S"])
def _attn_kernel(q_ptr, k_ptr, v_ptr, b_ptr, o_ptr, T, S, H, HK_DIV, D, DV, scale,
                 sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                 sbb, sbh, sbt, sbs, sob, soh, sot, sod,
                 HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // HK_DIV
    rm = pid_m * BM + tl.arange(0, BM)
    rd = tl.arange(0, BD)
    rdv = tl.arange(0, BDV)
    q = tl.load(q_ptr + b * sqb + h * sqh + rm[:, None] * sqt + rd[None, :] * sqd,
                mask=(rm[:, None] < T) & (rd[None, :] < D), other=0.0)
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, BDV), dtype=tl.float32)
    end = S
    if CAUSAL:  # keys after the block's last row are masked for every row of it
        end = tl.minimum(S, (pid_m + 1) * BM + (S - T))
    for n0 in range(0, end, BN):
        rn = n0 + tl.arange(0, BN)
        kt = tl.load(k_ptr + b * skb + hk * skh + rn[None, :] * sks + rd[:, None] * skd,
                     mask=(rn[None, :] < S) & (rd[:, None] < D), other=0.0)
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = s * scale
        if HAS_BIAS:
            s = s + tl.load(b_ptr + b * sbb + h * sbh + rm[:, None] * sbt + rn[None, :] * sbs,
                            mask=(rm[:, None] < T) & (rn[None, :] < S), other=0.0)
        visible = rn[None, :] < S
        if CAUSAL:
            visible = visible & (rn[None, :] <= rm[:, None] + (S - T))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vb = tl.load(v_ptr + b * svb + hk * svh + rn[:, None] * svs + rdv[None, :] * svd,
                     mask=(rn[:, None] < S) & (rdv[None, :] < DV), other=0.0)
        if IEEE:
            pv = tl.dot(p.to(vb.dtype), vb, input_precision="ieee")
        else:
            pv = tl.dot(p.to(vb.dtype), vb)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row with no visible key gives 0
    tl.store(o_ptr + b * sob + h * soh + rm[:, None] * sot + rdv[None, :] * sod,
             out.to(o_ptr.dtype.element_ty), mask=(rm[:, None] < T) & (rdv[None, :] < DV))


def _as_bias(mask: torch.Tensor | None, b: int, h: int, t: int, s: int) -> torch.Tensor | None:
    """An SDPA mask (bool: True = attend, or additive) as an fp32 additive bias [B, H, T, S]
    (broadcast dims keep stride 0)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        zero = torch.zeros((), device=mask.device)
        bias = torch.where(mask, zero, torch.full((), float("-inf"), device=mask.device))
    else:
        bias = mask.float()
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    return bias.expand(b, h, t, s)


def _attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, causal: bool,
              scale: float) -> torch.Tensor:
    b, h, t, d = q.shape
    hk, s, dv = k.shape[1], k.shape[2], v.shape[3]
    out = torch.empty(b, h, t, dv, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    bias_arg = bias if bias is not None else q
    bs = bias.stride() if bias is not None else (0, 0, 0, 0)
    grid = (triton.cdiv(t, ATT_BLOCK_M), b * h)
    _attn_kernel[grid](q, k, v, bias_arg, out, t, s, h, h // hk, d, dv, scale, *q.stride(), *k.stride(),
                       *v.stride(), *bs, *out.stride(), HAS_BIAS=bias is not None, CAUSAL=causal,
                       IEEE=q.dtype == torch.float32, BM=ATT_BLOCK_M, BN=ATT_BLOCK_N,
                       BD=max(16, triton.next_power_of_2(d)), BDV=max(16, triton.next_power_of_2(dv)))
    return out


class _InvariantAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                causal: bool, scale: float) -> torch.Tensor:
        ctx.save_for_backward(q, k, v, bias)
        ctx.causal, ctx.scale = causal, scale
        return _attn_fwd(q, k, v, bias, causal, scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, bias = ctx.saved_tensors
        t, s = q.shape[2], k.shape[2]
        if ctx.causal:  # SDPA's is_causal aligns top-left; this kernel's causal, bottom-right
            keep = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
            causal = torch.where(keep, 0.0, float("-inf")).to(q.device)
            bias = causal if bias is None else bias + causal
        with torch.enable_grad():
            qd, kd, vd = (x.detach().requires_grad_(x.requires_grad) for x in (q, k, v))
            out = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=None if bias is None else bias.to(q.dtype),
                scale=ctx.scale, enable_gqa=kd.shape[1] != qd.shape[1])
            wrt = [x for x in (qd, kd, vd) if x.requires_grad]
            grads = iter(torch.autograd.grad(out, wrt, grad))
        return (*(next(grads) if x.requires_grad else None for x in (qd, kd, vd)), None, None, None)


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                        is_causal: bool, scale: float | None) -> torch.Tensor:
    """SDPA q [B, Hq, T, d], k [B, Hk, S, d], v [B, Hk, S, dv] -> [B, Hq, T, dv] (Hk divides Hq:
    grouped-query heads share their key head), each row's result independent of T and B.
    Causal aligns the last query with the last key (query i sees keys <= i + S - T)."""
    b, h, t, d = q.shape
    if k.shape[1] == 0 or h % k.shape[1]:
        raise ValueError(f"invariant_attention: {k.shape[1]} key heads do not divide {h} query heads")
    bias = _as_bias(attn_mask, b, h, t, k.shape[2])
    return _InvariantAttention.apply(q, k, v, bias, bool(is_causal), d**-0.5 if scale is None else float(scale))


@triton.jit(do_not_specialize=["R"])
def _grouped_kernel(x_ptr, w_ptr, o_ptr, tile_e_ptr, tile_r0_ptr, off_ptr, R, E, N, K,
                    sxm, sxk, swe, swn, swk, som, son,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_e_ptr + pid_t)
    live = e < E
    e = tl.minimum(e, E - 1)
    r0 = tl.load(tile_r0_ptr + pid_t)
    r_end = tl.where(live, tl.load(off_ptr + e + 1), r0)  # a tile past the last expert does nothing
    rm = r0 + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rows = rm[:, None] < r_end
    acc = _tile_dot(x_ptr, w_ptr + e * swe, rm, rn, rows, N, K, sxm, sxk, swn, swk, BM, BN, BK, IEEE)
    tl.store(o_ptr + rm[:, None] * som + rn[None, :] * son, acc.to(o_ptr.dtype.element_ty),
             mask=rows & (rn[None, :] < N))


def _tiles(counts: torch.Tensor, offsets: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each BM-row tile's expert and first row, on the device (no host sync, so decode graphs
    capture it). The grid is the static bound ceil(R / BM) + E; tiles past the end get expert E."""
    per = (counts + LIN_BLOCK_M - 1) // LIN_BLOCK_M
    cum = torch.cumsum(per, 0)
    idx = torch.arange(triton.cdiv(rows, LIN_BLOCK_M) + counts.numel(), device=counts.device)
    e = torch.searchsorted(cum, idx, right=True)
    ec = e.clamp(max=counts.numel() - 1)
    r0 = offsets[ec] + (idx - (cum[ec] - per[ec])) * LIN_BLOCK_M
    return e.to(torch.int32), r0.to(torch.int32)


def _grouped_fwd(xs: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    r, k = xs.shape
    e, n = w.shape[0], w.shape[1]
    out = torch.empty(r, n, dtype=xs.dtype, device=xs.device)
    if r == 0:
        return out
    offsets = torch.cat((counts.new_zeros(1), torch.cumsum(counts, 0))).to(torch.int32)
    tile_e, tile_r0 = _tiles(counts, offsets, r)
    grid = (tile_e.numel(), triton.cdiv(n, LIN_BLOCK_N))
    _grouped_kernel[grid](xs, w, out, tile_e, tile_r0, offsets, r, e, n, k, xs.stride(0), xs.stride(1),
                          w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
                          BM=LIN_BLOCK_M, BN=LIN_BLOCK_N, BK=LIN_BLOCK_K, IEEE=xs.dtype == torch.float32)
    return out


class _InvariantGrouped(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, xs: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(xs, w, counts)
        return _grouped_fwd(xs, w, counts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xs, w, counts = ctx.saved_tensors
        gx = torch.zeros_like(xs) if ctx.needs_input_grad[0] else None
        gw = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        start = 0
        for e, c in enumerate(counts.tolist()):  # backward is not on the invariant contract
            if c:
                g = grad[start : start + c]
                if gx is not None:
                    gx[start : start + c] = g @ w[e]
                if gw is not None:
                    gw[e] = g.t() @ xs[start : start + c]
                start += c
        return gx, gw, None


def invariant_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                      down: torch.Tensor, inter: int) -> torch.Tensor:
    """SwiGLU experts (gate_up [E, 2I, H], down [E, H, I]) on tokens x [N, H] routed to ids [N, k]
    with weights [N, k]: rows sorted by expert, one grouped Triton GEMM per projection, each
    token's k outputs summed in slot order. A token's bits do not depend on the other tokens."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0])
    xs = x[order // k]
    gu = _InvariantGrouped.apply(xs, gate_up, counts)
    h = F.silu(gu[:, :inter]) * gu[:, inter:]
    y = _InvariantGrouped.apply(h, down, counts)[torch.argsort(order)].view(n, k, -1)
    w = weights.to(x.dtype)
    out = y[:, 0] * w[:, :1]
    for j in range(1, k):
        out = out + y[:, j] * w[:, j : j + 1]
    return out
