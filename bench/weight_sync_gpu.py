"""Weight-sync benchmark on one GPU: time per update vs model size and bucket size.

The trainer side (this process) and one engine process (a real EngineActor, bf16 model
built on the GPU) share the GPU. Transports:
  cuda_ipc       colocated handoff; the trainer's weights in one flat buffer (as Megatron's
                 contiguous parameter buffer), so a bucket is one copy
  cuda_ipc_sep   the same, the trainer's weights as separate allocations (one copy per tensor)
  ucx            UCXX GPU to GPU (UCX picks cuda_ipc on one GPU), when UCXX is installed
Limits measured in this run: device-to-device copy of the same bytes (the cuda_ipc goal:
>= 50% of it), pinned host->device and device->host copies, and a bare UCXX GPU send of
the same bytes in the same buckets (ucx's raw channel). GB/s = model bytes / update time
(pause -> every bucket staged -> atomic commit -> resume), best of `--reps`.

Usage: python bench/weight_sync_gpu.py [--sizes-gb 0.5,2,8] [--buckets-mib 128,512,1024]
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import weight_sync as ws  # bench/ is on sys.path when this file runs as a script

from miles.models.hf_io import hf_tensor_views

HIDDEN = 2048
LAYER_BYTES = 100_663_296  # one qwen3 layer at hidden 2048, intermediate 6144, bf16


def flatten(model: torch.nn.Module) -> None:
    """Put every parameter into one contiguous buffer, in parameter order."""
    params = list(model.parameters())
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    pos = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            flat[pos:pos + n].view(p.shape).copy_(p.data)
            p.data = flat[pos:pos + n].view(p.shape)
            pos += n


def timed(fn: Any, nbytes: int, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def limits(total: int) -> dict[str, float]:
    buf = {"a": torch.ones(total, dtype=torch.uint8, device="cuda"),
           "b": torch.empty(total, dtype=torch.uint8, device="cuda"),
           "h": torch.empty(total, dtype=torch.uint8, pin_memory=True)}
    out = {"d2d": timed(lambda: buf["b"].copy_(buf["a"]), total),
           "h2d_pinned": timed(lambda: buf["a"].copy_(buf["h"], non_blocking=True), total),
           "d2h_pinned": timed(lambda: buf["h"].copy_(buf["a"], non_blocking=True), total)}
    buf.clear()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-gb", default="0.5,2,8")
    ap.add_argument("--buckets-mib", default="128,512,1024")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    has_ucx = importlib.util.find_spec("ucxx") is not None
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="miles-bench-sync-gpu-") as tmp:
        root = Path(tmp)
        for gb in [float(x) for x in a.sizes_gb.split(",")]:
            layers = max(1, round(gb * 1e9 / LAYER_BYTES))
            ready = str(root / f"eready-{layers}")
            eng, directory = ws.spawn(["--serve-engine", str(HIDDEN), str(layers), ready, "cuda"], ready)
            try:
                model = ws.make_model(HIDDEN, layers, 2, "cuda")  # separate allocations per tensor
                flat = ws.make_model(HIDDEN, layers, 2, "cuda")
                flatten(flat)  # the same weights in one contiguous buffer
                total = sum(t.numel() * t.element_size() for t in hf_tensor_views(model).values())  # type: ignore[arg-type]
                lim = limits(total)
                for mib in [int(x) for x in a.buckets_mib.split(",")]:
                    got: dict[str, float] = {}
                    got["cuda_ipc_sep"] = asyncio.run(ws.miles_update(directory, model, "cuda_ipc", mib, a.reps, root,
                                                                      "cuda"))
                    if has_ucx:
                        got["ucx"] = asyncio.run(ws.miles_update(directory, model, "ucx", mib, a.reps, root, "cuda"))
                        got["ucx_raw"] = ws.raw_ucx(root / f"ucx-{layers}-{mib}", total, mib << 20, a.reps, "cuda")
                    got["cuda_ipc"] = asyncio.run(ws.miles_update(directory, flat, "cuda_ipc", mib, a.reps, root,
                                                                  "cuda"))
                    rows.append({"model_gb": total / 1e9, "bucket_mib": mib, **{k: round(v, 2) for k, v in got.items()},
                                 **{f"{k}_limit": round(v, 1) for k, v in lim.items()}})
                    print(json.dumps(rows[-1]), flush=True)
                del model, flat
                torch.cuda.empty_cache()
            finally:
                eng.terminate()
                eng.wait(30)
    print(f"{'model GB':>8} {'bucket':>6} {'ipc GB/s':>9} {'ipc/D2D':>7} {'ipc sep':>8} {'ucx GB/s':>8} "
          f"{'ucx/raw':>7} {'D2D':>7} {'H2D pin':>7} {'D2H pin':>7}")
    for r in rows:
        ucx = r.get("ucx", float("nan"))
        print(f"{r['model_gb']:8.2f} {r['bucket_mib']:6d} {r['cuda_ipc']:9.1f} {r['cuda_ipc'] / r['d2d_limit']:7.2f} "
              f"{r['cuda_ipc_sep']:8.1f} {ucx:8.1f} {ucx / r.get('ucx_raw', float('nan')):7.2f} "
              f"{r['d2d_limit']:7.0f} {r['h2d_pinned_limit']:7.1f} {r['d2h_pinned_limit']:7.1f}")
    best = max(rows, key=lambda r: r["cuda_ipc"] / r["d2d_limit"])
    out = {"cuda_ipc_vs_d2d_best": round(best["cuda_ipc"] / best["d2d_limit"], 3),
           "cuda_ipc_vs_d2d_largest": round(rows[-1]["cuda_ipc"] / rows[-1]["d2d_limit"], 3),
           "best_at": {"model_gb": round(best["model_gb"], 2), "bucket_mib": best["bucket_mib"]},
           "goal": 0.5, "rows": rows}
    if has_ucx:
        out["ucx_vs_raw_largest"] = round(rows[-1]["ucx"] / rows[-1]["ucx_raw"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
