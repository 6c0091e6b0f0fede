"""Trainer checkpoints (torch.distributed.checkpoint) and HF-layout export from FSDP shards.

A checkpoint directory holds the DCP shards of model + optimizer, `meta.json` (step,
weight version, optimizer steps; written by rank 0) and one `rng_rank{r}.bin` per rank
(raw RNG state bytes). Nothing is pickled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from miles.core.errors import TrainerError
from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.models.hf_io import hf_tensor_views, load_hf_tensors, save_model
from miles.models.registry import build_model
from miles.trainer.sharding import is_dtensor


def save(
    path: str | Path, module: nn.Module, opt: torch.optim.Optimizer, meta: dict[str, Any]
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    msd, osd = get_state_dict(module, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(d))
    rank = dist.get_rank()
    torch.get_rng_state().numpy().tofile(d / f"rng_rank{rank}.bin")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.get_rng_state().numpy().tofile(d / f"cuda_rng_rank{rank}.bin")
    if rank == 0:
        (d / "meta.json").write_text(json.dumps(meta, indent=2))
    dist.barrier()


def load(path: str | Path, module: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    d = Path(path)
    rank = dist.get_rank()
    if not (d / "meta.json").is_file():
        raise TrainerError(f"{str(d)!r} is not a trainer checkpoint (no meta.json)")
    if not (d / f"rng_rank{rank}.bin").is_file():
        raise TrainerError(
            f"checkpoint {str(d)!r} has no RNG state for rank {rank}; was it saved with fewer ranks?"
        )
    msd, osd = get_state_dict(module, opt)
    state: dict[str, Any] = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(d))
    set_state_dict(module, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = np.fromfile(d / f"rng_rank{rank}.bin", dtype=np.uint8)
    torch.set_rng_state(torch.from_numpy(rng))
    cuda_rng = d / f"cuda_rng_rank{rank}.bin"
    if cuda_rng.is_file() and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.from_numpy(np.fromfile(cuda_rng, dtype=np.uint8)))
    return dict(json.loads((d / "meta.json").read_text()))


class _OneParam:
    """Duck-types the part of CausalLM that `hf_tensor_views` reads, for one parameter, so
    HF naming (fused and stacked tensors split) stays defined in one place, models/hf_io."""

    def __init__(self, spec: ModelSpec, name: str, tensor: torch.Tensor) -> None:
        self.spec = spec
        self._item = (name, nn.Parameter(tensor, requires_grad=False))

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        yield self._item


def iter_hf_state(model: CausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full fp32 tensor) for every weight, gathered from the FSDP shards one
    parameter at a time.

    Gathering is a collective: every rank must consume the iterator to the end, in step.
    """
    for name, p in model.named_parameters():
        full = p.full_tensor() if is_dtensor(p) else p
        views = hf_tensor_views(_OneParam(model.spec, name, full.detach()))
        yield from views.items()


def export_hf(path: str | Path, model: CausalLM, state: Any = None) -> None:
    """Write an HF checkpoint (config.json + safetensors) from rank 0; every rank must call.

    `state` is the (HF name, full tensor) stream to write; default: the model's own weights.
    """
    rank = dist.get_rank()
    plain = build_model(model.spec, dtype=torch.float32) if rank == 0 else None
    named = ((k, v.to("cpu")) for k, v in (state if state is not None else iter_hf_state(model)))
    if plain is not None:
        load_hf_tensors(plain, named)
        save_model(plain, path)
    else:
        for _ in named:
            pass
    dist.barrier()
