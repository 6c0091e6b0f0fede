"""Weight-sync benchmark on one GPU: time per update vs model size and bucket size.

The trainer side (this process) and one engine process (a real EngineActor, bf16 model
built on the GPU) share the GPU. Transports:
  cuda_ipc       colocated handoff of a flat export (weightsync/flat.py): the trainer's
                 weights in one buffer in HF order, its plan sent once, every version moved
                 as byte-range buckets (one copy each, no per-tensor work)
  cuda_ipc_tensors  the same buffer pushed tensor by tensor (the generic path: a bucket is
                 still one copy, but every version lists, buckets and stages ~900 tensors)
  cuda_ipc_sep   tensor by tensor, the trainer's weights as separate allocations
  ucx            UCXX GPU to GPU (UCX picks cuda_ipc on one GPU), when UCXX is installed
                 and --ucx is given
Limits measured in this run: device-to-device copy of the same bytes (the cuda_ipc goal:
>= 50% of it), pinned host->device and device->host copies, and a bare UCXX GPU send of
the same bytes in the same buckets (ucx's raw channel). GB/s = model bytes / update time
(pause -> every bucket staged -> atomic commit -> resume), best of `--reps`.

The per-version fixed cost of the flat path is estimated from the two largest sizes at
each bucket size (time = fixed + bytes / rate).

Usage: python bench/weight_sync_gpu.py [--sizes-gb 2,8] [--buckets-mib 512,1024,2048,4096] [--ucx]
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
from miles.weightsync.flat import FlatWeights
from miles.weightsync.param_buffer import pack_parameters

HIDDEN = 2048
LAYER_BYTES = 100_663_296  # one qwen3 layer at hidden 2048, intermediate 6144, bf16


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
    ap.add_argument("--sizes-gb", default="2,8")
    ap.add_argument("--buckets-mib", default="512,1024,2048,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ucx", action="store_true", help="also time ucx (and raw UCXX) at each size")
    a = ap.parse_args()
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    has_ucx = a.ucx and importlib.util.find_spec("ucxx") is not None
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
                pack_parameters(list(flat.parameters()))  # the same weights in one buffer, in HF order
                fw = FlatWeights.of(hf_tensor_views(flat).items())  # type: ignore[arg-type]  # built once, like its plan
                total = fw.plan.nbytes
                lim = limits(total)
                for mib in [int(x) for x in a.buckets_mib.split(",")]:
                    got: dict[str, float] = {}
                    runs: list[tuple[str, torch.nn.Module, str, Any]] = [
                        ("cuda_ipc", flat, "cuda_ipc", lambda fw=fw: fw), ("cuda_ipc_tensors", flat, "cuda_ipc", None),
                        ("cuda_ipc_sep", model, "cuda_ipc", None), *([("ucx", model, "ucx", None)] if has_ucx else [])]
                    for key, m, tr, export in runs:
                        got[key] = asyncio.run(ws.miles_update(directory, m, tr, mib, a.reps, root, "cuda", export))
                    if has_ucx:
                        got["ucx_raw"] = ws.raw_ucx(root / f"ucx-{layers}-{mib}", total, mib << 20, a.reps, "cuda")
                    rows.append({"model_gb": total / 1e9, "bucket_mib": mib, **{k: round(v, 2) for k, v in got.items()},
                                 **{f"{k}_limit": round(v, 1) for k, v in lim.items()}})
                    print(json.dumps(rows[-1]), flush=True)
                del model, flat, fw
                torch.cuda.empty_cache()
            finally:
                eng.terminate()
                eng.wait(30)
    print(f"{'model GB':>8} {'bucket':>6} {'ipc GB/s':>9} {'ipc/D2D':>7} {'tensors':>8} {'sep':>7} {'ucx GB/s':>8} "
          f"{'ucx/raw':>7} {'D2D':>7} {'H2D pin':>7} {'D2H pin':>7}")
    for r in rows:
        ucx = r.get("ucx", float("nan"))
        print(f"{r['model_gb']:8.2f} {r['bucket_mib']:6d} {r['cuda_ipc']:9.1f} {r['cuda_ipc'] / r['d2d_limit']:7.2f} "
              f"{r['cuda_ipc_tensors']:8.1f} {r['cuda_ipc_sep']:7.1f} {ucx:8.1f} "
              f"{ucx / r.get('ucx_raw', float('nan')):7.2f} "
              f"{r['d2d_limit']:7.0f} {r['h2d_pinned_limit']:7.1f} {r['d2h_pinned_limit']:7.1f}")
    fixed = {}
    for mib in sorted({r["bucket_mib"] for r in rows}):
        pts = sorted((r["model_gb"], r["model_gb"] / r["cuda_ipc"]) for r in rows if r["bucket_mib"] == mib)
        if len(pts) >= 2:  # time = fixed + bytes / rate, from the two largest sizes
            (g1, t1), (g2, t2) = pts[-2], pts[-1]
            slope = (t2 - t1) / (g2 - g1)
            fixed[mib] = {"fixed_ms": round((t1 - slope * g1) * 1e3, 2), "rate_gbps": round(1 / slope, 1)}
    if fixed:
        print("flat path, time = fixed + bytes/rate: " + ", ".join(
            f"{m} MiB: {v['fixed_ms']} ms + {v['rate_gbps']} GB/s" for m, v in fixed.items()))
    best = max(rows, key=lambda r: r["cuda_ipc"] / r["d2d_limit"])
    largest = [r for r in rows if r["model_gb"] == rows[-1]["model_gb"]]
    default = next((r for r in largest if r["bucket_mib"] == 512), largest[0])
    out = {"cuda_ipc_vs_d2d_best": round(best["cuda_ipc"] / best["d2d_limit"], 3),
           "cuda_ipc_vs_d2d_largest": round(max(r["cuda_ipc"] / r["d2d_limit"] for r in largest), 3),
           "cuda_ipc_vs_d2d_default_bucket": round(default["cuda_ipc"] / default["d2d_limit"], 3),
           "best_at": {"model_gb": round(best["model_gb"], 2), "bucket_mib": best["bucket_mib"]},
           "goal": 0.5, "fixed_cost": {str(k): v for k, v in fixed.items()}, "rows": rows}
    if has_ucx:
        out["ucx_vs_raw_largest"] = round(rows[-1]["ucx"] / rows[-1]["ucx_raw"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
