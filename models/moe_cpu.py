"""The routed experts in the engine's CPU inference: dense on every expert, or only the selected.

Only under `torch.inference_mode()` on the CPU, which is the engine's stepper alone: the trainer
never runs there, so its dispatch (and its bits) stay `Experts.forward`'s own.

Measured (bench/moe_dispatch_cpu.py, bench/results/moe_dispatch_cpu_s18.txt; one thread, 2-core
AMD EPYC shared at load 1.4-2.2, us of CPU per layer call, hot weights):

  16 experts top-4, hidden 128, inter 64 (bench/engine.py's CPU MoE)
    N        1     8    16    24    32    64   256
    dense  112   234   366   604   512   830  3512
    loop   206   626   834   921   761   882  1785   (Experts._grouped: a Python loop of GEMMs)
    gmm    201   332   389   440   415   490  1159   (torch._grouped_mm: the same loop in C++)
  64 experts top-8, hidden 512, inter 128
    N        1     8    32   256
    dense 4283 10228 16970 111210
    loop   558  4444  9541  21176
    gmm    579  3508  7697  17488

A decode step of the bench's model (N=8) reads the weights of ~14 of its 16 experts anyway (its
routing, counted), so the selected-only paths save multiply-adds, not weight reads, and their
fixed cost (a sort, offsets, gathers, a GEMM pair per active expert) is larger than the saving
until N ~ 20. With 64 experts of 768 KB each, dense reads 8x the weights the tokens need and
loses from N = 1. `prefer_dense` models both: the dense path's waste is its unselected
multiply-adds plus one per byte of the experts no token can have chosen, against a fixed cost
per expert (`OVERHEAD_MACS`). (These GEMMs run at 30-36 G multiply-adds/s: dense's slope on the
first shape; weights come from memory at ~12 GB/s: dense at N = 1 on the second, so a byte costs
1-3 multiply-adds; 1 or 3 picks the same on both shapes.) It picks dense for N <= 16 and gmm
from N = 24 on the first shape, gmm at every N on the second, as measured.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from miles.models.grouped_moe import grouped_mm_aligned

# The selected path's fixed cost per expert, in multiply-adds of the dense path's waste
# (Experts' own CPU constant, which puts this crossover at N ~ 16 on the bench's model).
OVERHEAD_MACS = 3e5


def prefer_dense(n: int, k: int, num_experts: int, gate_up_rows: int, hidden: int, elem_bytes: int) -> bool:
    """Whether every expert on every token (n tokens, top-k) costs less than the selected ones."""
    per_expert_token = gate_up_rows * 3 // 2 * hidden  # gate, up and down multiply-adds
    wasted_macs = n * (num_experts - k) * per_expert_token
    unread = max(num_experts - n * k, 0) * per_expert_token * elem_bytes  # weights no token needs
    return wasted_macs + unread <= num_experts * OVERHEAD_MACS


@cache
def grouped_mm_on_cpu(dtype: torch.dtype) -> bool:
    """Whether this torch has a CPU `torch._grouped_mm` for `dtype` (2.9 and later: an ATen
    loop of GEMMs); older builds take the Python loop instead."""
    try:
        a = torch.ones(2, 16, dtype=dtype)  # 16 columns: rows a multiple of 16 bytes (see below)
        torch._grouped_mm(a, torch.ones(1, 16, 16, dtype=dtype), offs=torch.tensor([2], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def grouped_mm_fits(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `selected_experts` can run these operands: aligned as the kernel checks (it raises
    "strides should be multiple of 16 bytes" otherwise, e.g. fp32 hidden 6 or bf16 hidden 8),
    in a dtype this torch's CPU kernel takes."""
    return grouped_mm_aligned(x, gate_up, down) and grouped_mm_on_cpu(x.dtype)


def selected_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor) -> torch.Tensor:
    """x [N, H]; ids, weights [N, k]; gate_up [E, 2I, H]; down [E, H, I] -> [N, H]: each token's
    k selected SwiGLU experts only, token slots sorted by expert into one GEMM pair through
    `torch._grouped_mm` (no weight is copied; an expert no token chose is skipped). A token
    routed to one expert twice gets both slots. Inference only: no autograd formula is needed."""
    k = ids.shape[1]
    inter = down.shape[-1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.bincount(flat, minlength=gate_up.shape[0]).cumsum(0).to(torch.int32)
    token_of = order // k
    gu = torch._grouped_mm(x.index_select(0, token_of), gate_up.transpose(1, 2), offs=offs)
    act = F.silu(gu[:, :inter]) * gu[:, inter:] * weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
    ys = torch._grouped_mm(act, down.transpose(1, 2), offs=offs)
    return torch.zeros_like(x).index_add_(0, token_of, ys)
