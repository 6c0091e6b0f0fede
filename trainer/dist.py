"""torch.distributed setup for trainer ranks and the small collectives the step needs.

gloo on CPU, NCCL on CUDA. The group address comes from MASTER_ADDR / MASTER_PORT (set
by the launcher or actor shell); a single rank needs no address and joins an in-process store.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from miles.core.errors import TrainerError


def pick_device(kind: str, rank: int) -> torch.device:
    """The rank's device for trainer.device as resolved (core/schema/runtime.py): cpu or cuda."""
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise TrainerError("trainer.device='cuda' but no CUDA device is visible")
        local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def ensure_process_group(rank: int, world: int, device: torch.device) -> None:
    """Join (or reuse) the default group; check that it matches `rank` / `world`."""
    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world:
            raise TrainerError(
                f"process group is rank {dist.get_rank()}/{dist.get_world_size()}, "
                f"trainer was given rank {rank}/{world}"
            )
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if world == 1:
        # One rank meets nobody, so it binds no port: a port picked earlier (by the launcher)
        # can be taken by another process's connection before this rank binds it, and CI saw
        # exactly that (EADDRINUSE at init, the run dead before its first step).
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise TrainerError(f"{world} trainer ranks need MASTER_ADDR and MASTER_PORT in the env")
    addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    dist.init_process_group(
        backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world
    )


class Collectives:
    """Sum / max all-reduce of small CPU tensors over the default group (on `device`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return t
        x = t.to(self.device).clone()
        dist.all_reduce(x, op=op)
        return x.to("cpu")

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.SUM)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.MAX)


def leave_process_group() -> None:
    """Wait for every rank, then shut the default group down: before a rank process leaves
    without interpreter teardown (torch's background threads can abort a multi-rank process
    at exit: "terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
