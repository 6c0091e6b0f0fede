"""Kernel timing as the engine runs kernels: replayed in a CUDA graph. The FP8 GEMM choice
(models/fp8_gemm.py) and the Triton kernel's config pick (models/fp8_triton.py) both time by it."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_time(fn: Callable[[], object], reps: int = 10) -> float:
    """ms per call, `reps` calls replayed as one CUDA graph (as the engine runs decode steps:
    eager timing would measure Triton's per-launch CPU cost instead, and penalise the two-kernel
    variant for it); eager if this cannot be captured."""
    fn()  # build the kernel
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        run: Callable[[], object] = graph.replay
        calls = reps
    except Exception:  # noqa: BLE001 - timing only
        run, calls = fn, 1
    run()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(3):
        run()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / (3 * calls)
