"""A GEMM self-check for an engine held to a share of the SMs under CUDA MPS.

Measured on the H200 (torch 2.11+cu130, driver 580.159, `bench/gpu/mps_probe.py`,
`bench/results/mps_probe_*_h200.txt`): with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40 the context
sees 52 of 132 SMs, and cuBLAS / cuBLASLt bf16 and fp16 GEMMs of 256 x 1024 x 1024 return
values off by 100 % (fp32 GEMMs and 8-row ones stay right; SDPA too), so the engine sampled
from NaN logits. The check runs the same GEMMs against an fp32 reference when the engine
starts under a limit, and refuses to serve on a stack where they are wrong.
"""

from __future__ import annotations

import os

import torch

from miles.core.errors import EngineError

TOLERANCE = 0.05  # relative to the reference's largest value; bf16 rounding gives ~0.004
SHAPES = ((8, 1024, 1024), (256, 1024, 1024))


def gemm_errors(device: torch.device) -> dict[str, float]:
    """Relative max error of half-precision GEMMs on `device` against fp32 on the CPU."""
    g = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        ref = a @ b
        for dt in (torch.bfloat16, torch.float16):
            y = (a.to(device, dt) @ b.to(device, dt)).float().cpu()
            out[f"{str(dt).removeprefix('torch.')} {m}x{k}x{n}"] = float((y - ref).abs().max() / ref.abs().max())
    return out


def check_gemms_under_sm_limit(device: torch.device, percent: int, tolerance: float = TOLERANCE) -> None:
    """Raise EngineError naming `engine.mps_thread_percent` when a GEMM under the limit is wrong."""
    bad = {name: err for name, err in gemm_errors(device).items() if not err <= tolerance}
    if bad:
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        worst = ", ".join(f"{name}: {err:.3g}" for name, err in bad.items())
        raise EngineError(
            f"engine.mps_thread_percent={percent}: GEMMs on {gpu} under the SM limit "
            f"(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', '')}) "
            f"return wrong values (relative error {worst}; torch {torch.__version__}); "
            "this BLAS stack is not usable under MPS partitioning: set engine.mps_thread_percent=0"
        )
