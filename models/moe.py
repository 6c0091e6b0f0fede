"""Sparse MoE block (Qwen3-MoE): softmax top-k router, SwiGLU experts, and routing replay (R3).

Routing replay: given expert ids replace the router's top-k choice, while the gate
weights are still the live router probabilities gathered at those ids (then
renormalised when `norm_topk_prob`), so the router keeps its gradient.
Expert weights are stored stacked ([E, ...], gate and up fused) for speed; `hf_io`
maps them to the per-expert HF names `mlp.experts.{e}.{gate,up,down}_proj.weight`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from miles.models.config import ModelSpec
from miles.models.errors import ModelInputError


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


class Experts(nn.Module):
    def __init__(self, num: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, inter))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [N, H]; ids, weights: [N, k] -> [N, H]."""
        n, k = ids.shape
        if n == 0:
            return torch.zeros_like(x)
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



class MoEBlock(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_experts = spec.num_experts
        self.top_k = spec.num_experts_per_tok
        self.norm_topk_prob = spec.norm_topk_prob
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = Experts(spec.num_experts, spec.hidden_size, spec.moe_intermediate_size)

    def forward(
        self, x: torch.Tensor, given_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, H]; given_ids: [B, T, k] or None -> (out [B, T, H], ids [B, T, k] int64)."""
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        logits = self.gate(flat)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        if given_ids is None:
            top_w, ids = torch.topk(probs, self.top_k, dim=-1)
        else:
            ids = given_ids.reshape(-1, self.top_k).to(device=x.device, dtype=torch.long)
            top_w = probs.gather(-1, ids)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(logits.dtype)
        out = self.experts(flat, ids, top_w)
        return out.view(b, t, h), ids.view(b, t, self.top_k)
