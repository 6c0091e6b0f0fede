"""HF tensors into a megatron GPTModel, and the model back out under canonical HF names.

Loading fuses each target's HF parts and keeps this rank's tensor-parallel slice and
local experts. Export is a collective over the tensor- and expert-parallel groups
(every rank must drain the iterator): slices are all-gathered, fused tensors split back
into HF tensors, and every expert of every expert-parallel rank is yielded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from miles.core.errors import TrainerError
from miles.models.config import ModelSpec
from miles.trainer.megatron.layout import (
    Target,
    expert_hf_names,
    fuse,
    local_experts,
    split,
    targets,
    tp_shard,
    tp_unshard,
)


def _ranks() -> tuple[int, int, int, int]:
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_model_parallel_world_size(),
    )


def model_targets(model: nn.Module, spec: ModelSpec) -> list[Target]:
    """The targets of this rank's model; raise TrainerError if names disagree with megatron's."""
    names = dict(model.named_parameters())
    _, _, ep_rank, ep = _ranks()
    tgs = targets(spec, names.keys(), ep_rank, ep)
    missing = sorted(set(names) - {t.mcore for t in tgs})
    unknown = [t.mcore for t in tgs if t.mcore not in names]
    if missing or unknown:
        raise TrainerError(
            f"megatron parameter names do not match the HF layout: unmapped {missing[:5]}, "
            f"absent {unknown[:5]}"
        )
    return tgs


@torch.no_grad()
def load_hf(model: nn.Module, spec: ModelSpec, hf: Mapping[str, torch.Tensor]) -> None:
    """Copy HF-named full tensors (any device/dtype) into this rank's megatron parameters."""
    params = dict(model.named_parameters())
    tp_rank, tp, _, _ = _ranks()
    for t in model_targets(model, spec):
        absent = [n for n in t.hf if n not in hf]
        if absent:
            raise TrainerError(f"HF state lacks {absent} for megatron parameter {t.mcore!r}")
        full = fuse(t.kind, [hf[n].float() for n in t.hf], spec)
        dst = params[t.mcore]
        src = tp_shard(t.kind, full, tp_rank, tp)
        if tuple(src.shape) != tuple(dst.shape):
            raise TrainerError(
                f"{t.mcore}: HF tensors give shape {tuple(src.shape)}, megatron has {tuple(dst.shape)}"
            )
        dst.copy_(src.to(device=dst.device, dtype=dst.dtype))


def _gather(t: torch.Tensor, group: object, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


@torch.no_grad()
def iter_hf(model: nn.Module, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full fp32 tensor on the model's device) for every weight; a collective."""
    from megatron.core import parallel_state as ps

    params = dict(model.named_parameters())
    tp_rank, tp, ep_rank, ep = _ranks()
    tp_group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    ep_group = ps.get_expert_model_parallel_group() if ep > 1 else None
    n_local = local_experts(spec, ep) if spec.is_moe else 0
    for t in model_targets(model, spec):
        local = params[t.mcore].detach()
        if t.expert is None:
            full = tp_unshard(t.kind, _gather(local, tp_group, tp))
            yield from zip(t.hf, split(t.kind, full, spec), strict=True)
            continue
        # experts are not tensor-parallel (expert_tensor_parallel_size = 1)
        j = t.expert - ep_rank * n_local
        for r, full in enumerate(_gather(local, ep_group, ep)):
            gate, up, down = expert_hf_names(t.layer, r * n_local + j)
            names = (gate, up) if t.kind == "glu" else (down,)
            yield from zip(names, split(t.kind, full, spec), strict=True)
