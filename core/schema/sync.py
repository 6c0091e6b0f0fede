"""Config section for weight synchronization (trainer -> engines)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.core.config import opt


@dataclass
class SyncConfig:
    transport: Literal["zmq", "ucx", "broadcast", "cuda_ipc", "disk_delta"] = opt(
        "zmq", "bulk channel the weight buckets travel on"
    )
    bucket_mib: int = opt(512, "fixed bucket size; a tensor larger than a bucket is split", "MiB")
    step_timeout_s: float = opt(120.0, "deadline of each sync step (stage, commit) per engine", "s")
    pause_mode: Literal["abort", "retract", "in_place", "none"] = opt(
        "in_place", "how generation pauses around a commit; 'none' relies on the atomic swap alone"
    )
    verify_every: int = opt(0, "compare engine checksums with the trainer's every N versions; 0 = never", "versions")
    dtype: Literal["float32", "bfloat16", "float16", "same"] = opt(
        "same", "dtype the weights travel in; 'same' = the trainer's export dtype"
    )
