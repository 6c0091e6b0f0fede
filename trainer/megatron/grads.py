"""Gradient reduction and clipping across megatron's process groups.

Each data-parallel rank backpropagates `world_dp x` its share of the global loss (as the
FSDP2 backend does), so summing over the data-parallel group and dividing by its size
gives the gradient of the global loss. Dense parameters are summed over the
data-parallel group; expert parameters (megatron marks them `allreduce = False`) over the
expert-data-parallel group, because an expert already received the gradients of every
token routed to it from its expert-parallel peers.

The clip norm counts every weight once: tensor-parallel slices are summed over the
tensor-parallel group, replicated parameters only from tensor-parallel rank 0, and the
experts over the expert-parallel group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from miles.trainer.dist import Collectives


class GroupCollectives(Collectives):
    """`Collectives` over one process group (the data-parallel group)."""

    def __init__(self, device: torch.device, group: object, size: int) -> None:
        super().__init__(device)
        self.group, self.size = group, size

    def _reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
        if self.size == 1:
            return t
        x = t.to(self.device).clone()
        dist.all_reduce(x, op=op, group=self.group)
        return x.to("cpu")


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    assert p.grad is not None  # reduce_and_clip gives every parameter a gradient first
    return p.grad


def _is_expert(p: torch.nn.Parameter) -> bool:
    return not getattr(p, "allreduce", True)


def _sum_flat(grads: Sequence[torch.Tensor], group: object, scale: float) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.mul_(scale)
    off = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[off : off + n].view_as(g))
        off += n


@torch.no_grad()
def reduce_and_clip(params: Sequence[torch.nn.Parameter], dp: int, max_norm: float) -> float:
    """Reduce gradients over data-parallel ranks, clip to `max_norm` (0 = off); return the norm."""
    from megatron.core import parallel_state as ps

    params = [p for p in params if p.requires_grad]
    for p in params:  # a rank that routed no token to an expert still joins the reduction
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    dense = [p for p in params if not _is_expert(p)]
    experts = [p for p in params if _is_expert(p)]
    if dp > 1:
        _sum_flat([_grad(p) for p in dense], ps.get_data_parallel_group(), 1.0 / dp)
        edp = ps.get_expert_data_parallel_group()
        if experts and dist.get_world_size(edp) > 1:
            _sum_flat([_grad(p) for p in experts], edp, 1.0 / dp)
        elif experts:
            for p in experts:
                _grad(p).mul_(1.0 / dp)
    dev = params[0].device
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    sq_dense = torch.zeros((), dtype=torch.float32, device=dev)
    for p in dense:
        if tp_rank == 0 or getattr(p, "tensor_model_parallel", False):
            sq_dense += _grad(p).float().pow(2).sum()
    if tp > 1:
        dist.all_reduce(sq_dense, group=ps.get_tensor_model_parallel_group())
    sq_exp = torch.zeros((), dtype=torch.float32, device=dev)
    for p in experts:
        sq_exp += _grad(p).float().pow(2).sum()
    if experts and ps.get_expert_model_parallel_world_size() > 1:
        dist.all_reduce(sq_exp, group=ps.get_expert_model_parallel_group())
    norm = float((sq_dense + sq_exp).sqrt())
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in params:
                _grad(p).mul_(coef)
    return norm
