"""Fused MoE dispatch: all experts as one grouped GEMM pair (`torch._grouped_mm`).

Token slots (token, j) are sorted by expert into one [M_pad, H] matrix, each expert's rows
a contiguous group, and `torch._grouped_mm` runs every expert's gate-up and down projection
in one launch each (forward and backward: it has autograd formulas). The plan is computed on
the device with static shapes and no host sync (no per-expert counts on the host), so the
path works inside CUDA-graph capture and costs a handful of kernels whatever the number of
experts, where the per-expert loop (`Experts._grouped`) costs a host sync and ~10 launches
per expert in forward and backward.

Layout: every group is padded to a multiple of `ALIGN` rows and to at least `ALIGN` rows
(padding rows are zeros, and an empty expert gets zero rows rather than an empty group, so
its weight gradient is an explicit 0), and the last group runs to the end of the buffer, so
every row of the input, output and gradient buffers lies inside some group: no row is left
uninitialised by the kernel, forward or backward. M_pad = round_up(N*k, ALIGN) + E*ALIGN
bounds the padded total for any routing.

Requirements of the CUDA kernel (torch 2.11, SM90 fast path): bf16 operands, int32 offsets,
every stride a multiple of 16 bytes (hidden and expert intermediate sizes multiples of 8).
`grouped_mm_supported` checks them; otherwise the caller uses another path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ALIGN = 8  # rows per group granule: 16 bytes of bf16, the kernel's alignment unit


@dataclass(frozen=True)
class GroupPlan:
    src: torch.Tensor  # [M_pad] int64: the token each padded row reads (N = a zero row)
    offs: torch.Tensor  # [E] int32: end row of each expert's group (the last = M_pad)
    slot_row: torch.Tensor  # [N*k] int64: the padded row holding slot (token, j), row-major
    slot_of_row: torch.Tensor  # [M_pad] int64: the slot each padded row holds (N*k = none)


def grouped_mm_aligned(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """One dtype, and every row stride and base address a multiple of 16 bytes: what
    `torch._grouped_mm` asks of its operands on CUDA and on the CPU alike."""
    size = x.element_size()
    return (
        x.dtype == gate_up.dtype == down.dtype
        and x.shape[-1] * size % 16 == 0
        and down.shape[-1] * size % 16 == 0
        and gate_up.data_ptr() % 16 == 0  # base addresses too (views into a flat buffer may not be)
        and down.data_ptr() % 16 == 0
    )


def grouped_mm_supported(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the CUDA `torch._grouped_mm` takes these operands (see the module doc)."""
    return hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16 and grouped_mm_aligned(x, gate_up, down)


def plan_groups(ids: torch.Tensor, num_experts: int) -> GroupPlan:
    """ids [N, k] (int) -> the padded sorted layout, computed on ids' device without a sync."""
    n, k = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # sorted position -> slot
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync for its size
    padded = ((counts + ALIGN - 1) // ALIGN * ALIGN).clamp_min(ALIGN)
    m_pad = -(-n * k // ALIGN) * ALIGN + num_experts * ALIGN
    pad_start = torch.cumsum(padded, 0) - padded
    sorted_start = torch.cumsum(counts, 0) - counts
    expert = flat[order]
    pos = torch.arange(n * k, device=ids.device)
    row = pad_start[expert] + pos - sorted_start[expert]  # padded row of each sorted position
    src = torch.full((m_pad,), n, dtype=torch.long, device=ids.device)
    src.scatter_(0, row, order // k)
    slot_row = torch.empty_like(row).scatter_(0, order, row)
    slot_of_row = torch.full((m_pad,), n * k, dtype=torch.long, device=ids.device)
    slot_of_row.scatter_(0, row, order)
    offs = torch.cumsum(padded, 0)
    offs[-1] = m_pad
    return GroupPlan(src=src, offs=offs.to(torch.int32), slot_row=slot_row, slot_of_row=slot_of_row)


def _gather_padded(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """[x; 0][src]: index N reads a zero row."""
    return torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, src)


def _gather_sum(g: torch.Tensor, slot_row: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's k rows summed: g[slot_row].view(N, k, H).sum(1) (fp32 accumulation inside
    the reduction, one rounding)."""
    return g.index_select(0, slot_row).view(slot_row.numel() // k, k, g.shape[1]).sum(1)


class _Dispatch(torch.autograd.Function):
    """Token rows to expert rows, [x; 0][src], with the adjoint as its backward: a gather and a
    sum over each token's k rows. Autograd's own backward of index_select is an index_add_ of
    bf16 rows with atomics: 10 % of a small MoE's train step on the H200 and nondeterministic."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, src: torch.Tensor,
                slot_row: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(slot_row)
        ctx.k = k
        return _gather_padded(x, src)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (slot_row,) = ctx.saved_tensors
        return _gather_sum(g, slot_row, ctx.k), None, None, None


class _Combine(torch.autograd.Function):
    """Expert rows back to tokens, each token's k rows summed: the adjoint of `_Dispatch`, so
    each one's backward is the other's forward (no atomics either way)."""

    @staticmethod
    def forward(ctx: Any, ys: torch.Tensor, src: torch.Tensor,
                slot_row: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(src)
        return _gather_sum(ys, slot_row, k)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (src,) = ctx.saved_tensors
        return _gather_padded(g, src), None, None, None


def grouped_swiglu_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """x [N, H]; ids, weights [N, k]; gate_up [E, 2I, H]; down [E, H, I] -> [N, H]:
    sum_j weights[:, j] * expert_{ids[:, j]}(x), each expert a SwiGLU MLP. The routing weight
    scales each row's activation before the down projection (as the dense path does), so the
    combine is a plain sum of a token's k rows: no batched GEMM of [N, 1, k] x [N, k, H] (13 %
    of a small MoE's train step on the H200, through a slow small-k kernel)."""
    n, k = ids.shape
    e, two_i, h = gate_up.shape
    inter = two_i // 2
    plan = plan_groups(ids, e)
    xs = _Dispatch.apply(x, plan.src, plan.slot_row, k)  # [M_pad, H]
    gu = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=plan.offs)  # [M_pad, 2I]
    # padding rows take weight 0 (slot N*k); their activation is 0 anyway (a zero input row)
    w_rows = torch.cat([weights.reshape(-1).to(x.dtype), weights.new_zeros(1, dtype=x.dtype)])
    act = F.silu(gu[:, :inter]) * gu[:, inter:] * w_rows.index_select(0, plan.slot_of_row).unsqueeze(1)
    ys = torch._grouped_mm(act, down.transpose(1, 2), offs=plan.offs)  # [M_pad, H]
    return _Combine.apply(ys, plan.src, plan.slot_row, k)
