"""Building the trainer's models and sharding them with FSDP2 (`fully_shard`).

Each decoder block is its own FSDP unit, then the root. The models' `CausalLM.forward`
calls a block's attention and MLP directly rather than the block itself; FSDP2 gathers a
unit's parameters in the unit's forward pre-hook, so in that case the attention and MLP
of each block become the units (the block's norms then live in the root unit).
Mixed precision: parameters are stored (and optimised) in fp32; on CUDA the forward and
backward run in bf16 and gradients are reduced in fp32.

One rank in fp32 stays a plain module: there FSDP2 would gather, reduce and reshard over a
group of one (identity copies) through per-unit hooks, ~20% of a small model's train step
on CPU, for the same numbers. With bf16 compute one rank is still wrapped: FSDP2's mixed
precision is what casts the fp32 master weights for each forward. There the gradient
"reduce-scatter" over a group of one is a copy between two fp32 buffers of the unit's size
(FSDP2's `foreach_reduce`): `InPlaceSingleRankReduce` makes them one buffer, so the largest
unit is not held twice at the end of each backward, the trainer's peak (docs/memory.md). An
untied model's embeddings are a unit of their own, so the root (output head, final norm)
reduces half the vocabulary-sized gradients at once (0.54 GB rather than 1.09 GB in fp32 for
Qwen2.5-0.5B).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch
from torch import nn

from miles.core.errors import ConfigError
from miles.core.schema.trainer import ParamDtype
from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.models.hf_io import load_model
from miles.models.registry import build_model

if TYPE_CHECKING:  # torch.distributed.device_mesh / fsdp are imported where a mesh is made
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor


_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# Whether a one-rank mesh reduces gradients in place (`InPlaceSingleRankReduce`); False is
# FSDP2's own two buffers (bench/trainer_memory.py's "before" cases set it).
SINGLE_RANK_REDUCE_IN_PLACE = True
# Whether an untied model's embeddings are an FSDP2 unit of their own (`_units`); False keeps
# them in the root unit (the "before" cases of bench/trainer_memory.py).
EMBEDDINGS_OWN_UNIT = True


def compute_dtype(name: ParamDtype) -> torch.dtype:
    """trainer.param_dtype as resolved for the trainer's device (core/schema/runtime.py)."""
    if name not in _DTYPES:
        raise ConfigError(f"trainer.param_dtype={name!r} is not resolved: build the trainer through "
                          "core/schema/runtime.py resolve_trainer")
    return _DTYPES[name]


def wraps(world: int, dtype: torch.dtype) -> bool:
    """Whether the trainer's models are FSDP2-wrapped: not for one rank computing in fp32."""
    return world > 1 or dtype != torch.float32


def is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    """`isinstance(t, DTensor)` without importing torch.distributed.tensor where nothing was
    sharded: a DTensor can exist only once that module is loaded."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def make_mesh(device: torch.device, world: int) -> DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))


def build_policy(spec: ModelSpec, init_checkpoint: str, seed: int) -> CausalLM:
    """fp32 master copy on CPU: loaded from an HF checkpoint, or seeded random init."""
    if init_checkpoint:
        model = load_model(init_checkpoint, dtype=torch.float32)
        if model.spec != spec:
            raise ConfigError(
                f"checkpoint {init_checkpoint!r} holds a different architecture than the given spec"
            )
        return model
    return build_model(spec, dtype=torch.float32, seed=seed)


def _units(model: nn.Module) -> list[nn.Module]:
    lm: Any = model  # a CausalLM (or a wrapper): its submodules are attributes torch does not type
    layers = lm.model.layers
    out: list[nn.Module] = []
    if EMBEDDINGS_OWN_UNIT and getattr(lm, "lm_head", None) is not None:
        # An untied model's embeddings are a unit of their own: the root (head, final norm) then
        # reduces half the vocabulary-sized gradients at once, and the embeddings' bf16 copy goes
        # after the forward instead of living through the backward. A tied head reads the
        # embedding weight outside the embedding's forward, where no FSDP2 hook would gather it.
        out.append(lm.model.embed_tokens)
    for layer in layers:
        if type(layer).forward is not nn.Module.forward:
            out.append(layer)
        else:
            out.extend([layer.self_attn, layer.mlp])
    return out


class InPlaceSingleRankReduce:
    """FSDP2's reduce-scatter comm (`set_custom_reduce_scatter`) for a group of one rank.

    FSDP2 asks the comm for the reduce input (the unit's bf16 gradients cast to fp32), then for
    an output of the same size, and copies input to output when the group has one rank
    (`foreach_reduce`); the gradients are views of the output. Here the output request returns
    the input buffer itself: the copy becomes a no-op and the unit's fp32 gradients exist once.
    The values are the same bytes. `__call__` is never reached for one rank; it refuses, so a
    torch whose FSDP2 starts calling it (or asks in another order) fails loudly instead of
    aliasing the wrong buffers.
    """

    def __init__(self) -> None:
        self._input: torch.Tensor | None = None  # the last input handed out, until its output is asked

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        pending, self._input = self._input, None
        if pending is not None:
            if tuple(pending.shape) != tuple(size) or pending.dtype != dtype or pending.device != device:
                raise RuntimeError(f"one-rank gradient reduce: FSDP2 asked for an output {tuple(size)} {dtype} "
                                   f"that differs from its input {tuple(pending.shape)} {pending.dtype}")
            return pending
        self._input = torch.empty(size, dtype=dtype, device=device)
        return self._input

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        raise RuntimeError("one-rank gradient reduce: FSDP2 called a reduce-scatter over one rank "
                           "(this torch's FSDP2 changed; set trainer.sharding.SINGLE_RANK_REDUCE_IN_PLACE = False)")


def _single_rank_reduce(module: nn.Module, mesh: DeviceMesh) -> None:
    # a torch whose FSDP2 has no custom reduce-scatter keeps its own two buffers (the same numbers)
    if SINGLE_RANK_REDUCE_IN_PLACE and mesh.size() == 1 and hasattr(module, "set_custom_reduce_scatter"):
        # an FSDPModule after fully_shard; the comm has ReduceScatter's two methods (FSDP2 checks no type)
        cast(Any, module).set_custom_reduce_scatter(InPlaceSingleRankReduce())


def shard(
    root: nn.Module,
    lms: list[nn.Module],
    mesh: DeviceMesh | None,
    device: torch.device,
    dtype: torch.dtype,
) -> nn.Module:
    """Move `root` to `device` and apply fully_shard to each block of each LM in `lms`, then root;
    with no mesh (one fp32 rank, see `wraps`) it stays a plain module."""
    root.to(device)
    if mesh is None:
        return root
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if dtype != torch.float32
        else MixedPrecisionPolicy()
    )
    for lm in lms:
        for unit in _units(lm):
            fully_shard(unit, mesh=mesh, mp_policy=mp)
            _single_rank_reduce(unit, mesh)
    fully_shard(root, mesh=mesh, mp_policy=mp)
    _single_rank_reduce(root, mesh)
    return root
