"""Reference limits measured on the spot: what this machine's memory system can do per size.

Host paths are compared with a memcpy of the same bytes; GPU paths with a device-to-device
copy, and the pinned host<->device copies are reported next to it. Each figure is the best
of a few repetitions (a limit is what the hardware can reach, not its average).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def _best_gbps(size: int, copy: Callable[[], object], sync: Callable[[], None], budget_s: float = 0.2) -> float:
    copy()
    sync()
    reps = 1
    best = float("inf")
    t_end = time.perf_counter() + budget_s
    # Small copies are timed in batches so the clock's resolution does not dominate.
    while True:
        t0 = time.perf_counter()
        for _ in range(reps):
            copy()
        sync()
        dt = (time.perf_counter() - t0) / reps
        best = min(best, dt)
        if time.perf_counter() > t_end:
            break
        if dt * reps < 1e-3:
            reps *= 4
    return size / best / 1e9


def host_limits(size: int) -> dict[str, float]:
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.ones(size, dtype=torch.uint8)
    threads = torch.get_num_threads()
    # One thread, as memcpy and every transport's copy run: torch's parallel copy would
    # measure thread contention on a shared machine instead of the memory system.
    torch.set_num_threads(1)
    try:
        return {"memcpy": _best_gbps(size, lambda: dst.copy_(src), lambda: None)}
    finally:
        torch.set_num_threads(threads)


def cuda_limits(size: int, device: torch.device) -> dict[str, float]:
    """D2D copy plus pinned H2D and D2H copies of `size` bytes on `device`."""
    sync = torch.cuda.synchronize
    a = torch.ones(size, dtype=torch.uint8, device=device)
    b = torch.empty(size, dtype=torch.uint8, device=device)
    h = torch.ones(size, dtype=torch.uint8).pin_memory()
    out = {"d2d": _best_gbps(size, lambda: b.copy_(a), sync),
           "h2d": _best_gbps(size, lambda: b.copy_(h, non_blocking=True), sync),
           "d2h": _best_gbps(size, lambda: h.copy_(a, non_blocking=True), sync),
           "memcpy": host_limits(size)["memcpy"]}
    return out
