"""What the weight channel cannot do where the local launcher places the roles, refused at launch.

`sync.transport = "broadcast"` makes one NCCL group of the sending trainer rank(s) and every
engine when the trainer is on CUDA, and NCCL cannot place two ranks of one group on one GPU (it
fails or hangs at init; transport/bulk/nccl_devices.py checks the real devices when the group
is made). A local launch (`miles train`: every role on this machine, one environment) already
tells where each member will be: trainer rank r on cuda:r (trainer/dist.py `pick_device`, no
LOCAL_RANK), and every engine on the one `engine.device`, cuda:N for "cuda:N" and the current
device, cuda:0, otherwise (launch/role.py sets only an explicit index; a receiver's NCCL buffers
follow it). Under Slurm each step may get GPUs of its own (--gpus-per-task): nothing is known
there, and the group's own check stands.
"""

from __future__ import annotations

from miles.core.schema import MilesConfig
from miles.core.schema.runtime import RuntimeFacts, resolve_trainer
from miles.transport.bulk.nccl_devices import FIX


def _gpu_index(device: str) -> int | None:
    """The CUDA index an engine's NCCL work runs on in a local launch (None: not an index we know)."""
    _, sep, idx = device.partition(":")
    if not sep:
        return 0  # "cuda" or "cpu": the process's current device, never set
    return int(idx) if idx.isdigit() else None


def broadcast_placement_errors(cfg: MilesConfig) -> list[str]:
    """The broadcast group of a local launch that would put two members on one GPU, with the fix."""
    eng, tr = cfg.engine, cfg.trainer
    if cfg.sync.transport != "broadcast":
        return []
    # The trainer's device as its start resolves it (core/schema/runtime.py). The launcher does not
    # import torch to ask for CUDA; in a local launch CUDA is visible here when the engines run on it.
    facts = RuntimeFacts(cuda=eng.device.startswith("cuda"))
    if resolve_trainer(tr, facts, moe=False).device != "cuda":
        return []  # a CPU trainer: gloo, whose members may share anything
    gpu = _gpu_index(eng.device)
    if gpu is None:
        return []
    senders = tr.world_size if cfg.sync.sharded else 1  # a gathered sync sends from rank 0 alone
    members = [f"trainer rank {gpu}"] if gpu < senders else []
    members += [f"engine {i}" for i in range(eng.num_engines)]
    if len(members) < 2:
        return []
    own = "" if eng.num_engines > 1 else f", or give the engine a GPU of its own (engine.device = 'cuda:{senders}')"
    return [f"sync.transport = 'broadcast' with a CUDA trainer: this launch puts {', '.join(members)} on one GPU "
            f"(cuda:{gpu}, engine.device = {eng.device!r}, trainer.device = {tr.device!r}), and NCCL cannot place "
            f"two ranks of one group on one GPU (it fails or hangs at init). Fix: {FIX}{own}"]
