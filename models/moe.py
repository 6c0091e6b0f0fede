"""Sparse MoE block (Qwen3-MoE): softmax top-k router, SwiGLU experts, and routing replay (R3).

Routing replay: given expert ids replace the router's top-k choice, while the gate
weights are still the live router probabilities gathered at those ids (then
renormalised when `norm_topk_prob`), so the router keeps its gradient.
Expert weights are stored stacked ([E, ...], gate and up fused) for speed; `hf_io`
maps them to the per-expert HF names `mlp.experts.{e}.{gate,up,down}_proj.weight`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from miles.models.config import ModelSpec
from miles.models.errors import ModelInputError
from miles.models.grouped_moe import grouped_mm_supported, grouped_swiglu_experts
from miles.models.invariant import invariant_active, triton_kernels
from miles.models.layers import MLP, no_global_hooks, plain_forward
from miles.models.moe_cpu import grouped_mm_fits, prefer_dense, selected_experts


def expert_id_dtype(num_experts: int) -> np.dtype:
    """Compact storage dtype for routed expert ids: uint8 up to 256 experts, else uint16."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 65536:
        return np.dtype(np.uint16)
    raise ModelInputError(f"{num_experts} experts do not fit uint16 expert ids")


def compact_expert_ids(ids: torch.Tensor, num_experts: int) -> np.ndarray:
    """Expert ids (any int tensor) as a numpy array in the compact dtype."""
    return ids.detach().to("cpu", torch.int32).numpy().astype(expert_id_dtype(num_experts))


# Rough cost of launching one expert's matmuls in the sorted-loop path, in multiply-adds:
# below it, running every expert densely on every token (and zero-weighting the
# unselected ones) is cheaper than looping over the active experts.
_LOOP_OVERHEAD_MACS = {"cpu": 3e5, "cuda": 2e9}
# The fused path's fixed cost (sort, plan, gathers: ~15 small kernels, ~50 us on an H200),
# in multiply-adds of the dense path's wasted work: below it, dense is cheaper (decode).
_GROUPED_MM_OVERHEAD_MACS = 2e10


def slot_ordered_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
                         expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [N, H], ids / weights [N, k] -> [N, H]: the tokens sorted by expert (one gather),
    `expert(e, rows)` once per active expert on its segment, the outputs put back in (token,
    slot) order and each token's k outputs summed in its own slot order, elementwise, so no
    reduction spans tokens (what the batch-invariant paths need)."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    xs = x[order // k]
    outs, start = [], 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        outs.append(expert(e, xs[start : start + c]))
        start += c
    y = torch.cat(outs)[torch.argsort(order)].view(n, k, -1)  # back to (token, slot) order
    w = weights.to(x.dtype)
    out = y[:, 0] * w[:, :1]
    for j in range(1, k):
        out = out + y[:, j] * w[:, j : j + 1]
    return out


class Experts(nn.Module):
    """E SwiGLU experts stacked: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, num: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.inter = inter
        # auto | loop | grouped_mm | dense: which dispatch runs (`forward`); the others are for
        # tests and benches. grouped_mm needs torch._grouped_mm's operands (bf16, aligned).
        self.impl = "auto"
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, inter))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [N, H]; ids, weights: [N, k] -> [N, H] (a fresh tensor)."""
        n, k = ids.shape
        if n == 0:
            return torch.zeros_like(x)
        if invariant_active():
            return self._invariant(x, ids, weights)
        impl = self.impl
        if impl == "loop":
            return self._grouped(x, ids, weights)
        if impl == "grouped_mm":
            return grouped_swiglu_experts(x, ids, weights, self.gate_up_proj, self.down_proj)
        # graph capture, and the engine's compiled decode (captured next on CUDA; run as is on the
        # CPU, engine.compile_decode_cpu): the other paths need per-expert counts on the host; a
        # decode batch is small enough that dense wins anyway. (is_compiling first: under a trace,
        # the capture query would break the graph.)
        if impl == "dense" or torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return self._dense(x, ids, weights)
        e, two_i, h = self.gate_up_proj.shape
        extra_macs = n * (e - k) * (two_i + self.inter) * h
        fused = x.is_cuda and grouped_mm_supported(x, self.gate_up_proj, self.down_proj)
        if fused:
            if extra_macs <= _GROUPED_MM_OVERHEAD_MACS:
                return self._dense(x, ids, weights)
            return grouped_swiglu_experts(x, ids, weights, self.gate_up_proj, self.down_proj)
        if x.is_cpu and torch.is_inference_mode_enabled():  # the engine's CPU steps
            return self._cpu_inference(x, ids, weights)
        if extra_macs <= e * _LOOP_OVERHEAD_MACS.get(x.device.type, 3e5):
            return self._dense(x, ids, weights)
        return self._grouped(x, ids, weights)

    def _cpu_inference(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The engine's CPU forward (no autograd; the trainer never gets here): dense while that
        is cheaper, else only the selected experts, through torch's CPU grouped GEMM where this
        torch has one (models/moe_cpu.py has the measured crossover)."""
        n, k = ids.shape
        e, two_i, h = self.gate_up_proj.shape
        if prefer_dense(n, k, e, two_i, h, x.element_size()):
            return self._dense(x, ids, weights)
        if grouped_mm_fits(x, self.gate_up_proj, self.down_proj):
            return selected_experts(x, ids, weights, self.gate_up_proj, self.down_proj)
        return self._grouped(x, ids, weights)

    def _dense(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, unselected ones weighted 0: three big ops instead of a
        loop of small ones (decode batches)."""
        n, e, i = x.shape[0], self.gate_up_proj.shape[0], self.inter
        gu = (x @ self.gate_up_proj.reshape(e * 2 * i, -1).t()).view(n, e, 2 * i)
        dense_w = torch.zeros(n, e, dtype=x.dtype, device=x.device).scatter_add_(1, ids, weights.to(x.dtype))
        act = F.silu(gu[..., :i]) * gu[..., i:] * dense_w.unsqueeze(-1)  # [N, E, I]
        return torch.bmm(act.transpose(0, 1), self.down_proj.transpose(1, 2)).sum(0)

    def _invariant(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """True on-policy dispatch: one path whatever N (no dense/grouped switch), expert
        matmuls through F.linear (tiled under `BatchInvariant`), and each token's k expert
        outputs summed in its own slot order, elementwise, so no reduction spans tokens.
        On CUDA: grouped Triton GEMMs with fixed tiles, no host sync (models/invariant_triton.py)."""
        if x.is_cuda and (kernels := triton_kernels()) is not None:
            return kernels.invariant_experts(x, ids, weights, self.gate_up_proj, self.down_proj, self.inter)
        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            h = F.linear(rows, self.gate_up_proj[e])
            return F.linear(F.silu(h[:, : self.inter]) * h[:, self.inter :], self.down_proj[e])

        return slot_ordered_experts(x, ids, weights, self.gate_up_proj.shape[0], expert)

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Tokens sorted by expert (one gather), one matmul pair per active expert's segment:
        the CPU path (exact in fp32; torch's CPU grouped GEMM is a loop too and its backward
        takes no broadcast gradients), and CUDA's where the fused one does not apply."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        token_of = order // k
        xs = x[token_of]
        w = weights.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
        outs = []
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            xe = xs[start : start + c]
            gu = xe @ self.gate_up_proj[e].t()
            h = F.silu(gu[:, : self.inter]) * gu[:, self.inter :]
            outs.append(h @ self.down_proj[e].t())
            start += c
        y = torch.cat(outs, dim=0) * w
        out = torch.zeros_like(x)
        out.index_add_(0, token_of, y)
        return out


class GroupLimitedGate(nn.Module):
    """The sigmoid router's parameters (HF names `gate.weight`, `gate.e_score_correction_bias`)
    and its selection rule. `forward(scores)` maps the sigmoid scores [N, E] (fp32) to the
    selection scores whose top-k is the choice: scores + bias, -inf outside the `topk_group`
    groups whose two best biased scores sum highest. Being the gate's output, they are what
    the trainer's router probe sees (its top-k is the live choice, as for a softmax gate).
    """

    def __init__(self, hidden: int, num_experts: int, n_group: int, topk_group: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        self.n_group, self.topk_group = n_group, topk_group

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        choice = scores + self.e_score_correction_bias.float()
        n, e = choice.shape
        if self.n_group > 1:
            group_scores = choice.view(n, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1], True)
            choice = choice.masked_fill(~keep.repeat_interleave(e // self.n_group, dim=1), float("-inf"))
        return choice


class MoEBlock(nn.Module):
    """Routed experts behind a router, plus optional shared experts (always on).

    Routers (`spec.router`):
    - "softmax" (Qwen3-MoE): top-k of softmax(logits); weights renormalised when `norm_topk_prob`.
    - "sigmoid_group" (GLM-4.5, DeepSeek-V3, Kimi K2): scores = sigmoid(logits) in fp32; the
      choice adds `e_score_correction_bias` and is limited to the `topk_group` groups (of
      `n_group`) whose two best biased scores sum highest; weights are the unbiased scores at
      the chosen ids, renormalised when `norm_topk_prob`, times `routed_scaling_factor`.
    Replay (R3) takes the ids and recomputes only the weights, the same way, so gradients
    reach the router in both kinds. `e_score_correction_bias` is a parameter without
    gradient: RL does not update it, but it is saved, loaded and synced like a weight.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_experts = spec.num_experts
        self.top_k = spec.num_experts_per_tok
        self.norm_topk_prob = spec.norm_topk_prob
        self.router = spec.router
        self.gate: nn.Module = (
            GroupLimitedGate(spec.hidden_size, spec.num_experts, spec.n_group, spec.topk_group)
            if spec.router == "sigmoid_group"
            else nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        )
        self.scale = spec.routed_scaling_factor
        self.experts = Experts(spec.num_experts, spec.hidden_size, spec.moe_intermediate_size)
        inter = spec.shared_expert_intermediate_size
        gated = spec.model_type == "qwen3_next"  # its one shared expert is scaled by a sigmoid gate
        self.shared_experts = MLP(spec.hidden_size, inter) if inter and not gated else None
        self.shared_expert = MLP(spec.hidden_size, inter) if inter and gated else None
        self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False) if inter and gated else None

    def _route(self, flat: torch.Tensor, given: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """flat [N, H] -> (weights [N, k] in the logits' dtype, ids [N, k] int64)."""
        if self.router == "softmax":
            logits = self.gate(flat)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            if given is None:
                top_w, ids = torch.topk(probs, self.top_k, dim=-1)
            else:
                ids = given
                top_w = probs.gather(-1, ids)
            if self.norm_topk_prob:
                top_w = top_w / top_w.sum(dim=-1, keepdim=True)
            return top_w.to(logits.dtype), ids
        scores = F.linear(flat.float(), cast(torch.Tensor, self.gate.weight).float()).sigmoid()
        choice = self.gate(scores)  # a module call: the router probe's hook sees the selection scores
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1] if given is None else given
        top_w = scores.gather(1, ids)
        if self.norm_topk_prob:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
        return top_w * self.scale, ids

    def forward(
        self, x: torch.Tensor, given_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, H]; given_ids: [B, T, k] or None -> (out [B, T, H], ids [B, T, k] int64).

        Both outputs are fresh tensors, not views (FSDP2 hooks on a module's output
        are lost through in-place ops on a view), except in the CPU engine's eager inference,
        where no hook runs and the two copies are a visible share of a small decode step.
        """
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        given = None
        if given_ids is not None:
            given = given_ids.reshape(-1, self.top_k).to(device=x.device, dtype=torch.long)
        top_w, ids = self._route(flat, given)
        # the CPU engine's eager inference: no hook runs on the experts (unless one is registered)
        eager = not torch.compiler.is_compiling() and x.is_cpu and torch.is_inference_mode_enabled()
        out = (plain_forward(self.experts) if eager and no_global_hooks() else self.experts)(flat, ids, top_w)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(F.linear(flat, self.shared_expert_gate.weight))
            out = out + gate * self.shared_expert(flat)
        out, ids = out.unflatten(0, (b, t)), ids.unflatten(0, (b, t))
        if eager:
            return out, ids
        return out.clone(), ids.clone()
