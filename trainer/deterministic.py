"""Deterministic mode: same seed and config -> the same losses and weights, step by step.

Seeding alone is not enough. This also switches torch to deterministic algorithms (an
op without one raises instead of silently varying), turns off TF32 and reduced-precision
GEMM reductions (whose split-K choice can vary), pins cuBLAS to a fixed workspace, fixes
NCCL to one algorithm and protocol so all-reduce sums in a fixed order, and derives every
sampling request's seed from (run seed, step, prompt, sample) with a stable hash, so the
engine draws the same tokens whatever else shares its batch.

The process-wide settings must be in place before CUDA / NCCL initialise: call
`enable_deterministic` first thing in a trainer or engine process.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import xxhash

_ENV = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NCCL_ALGO": "Ring",
    "NCCL_PROTO": "Simple",
}


def enable_deterministic(seed: int) -> None:
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


def request_seed(run_seed: int, *key: int | str) -> int:
    """A stable 48-bit sampling seed for one request, e.g. (run_seed, step, prompt, sample)."""
    h = xxhash.xxh64(repr((run_seed, *key)).encode(), seed=0).intdigest()
    return h & (2**48 - 1)
