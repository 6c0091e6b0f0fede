"""Streamed AdamW (moments on disk, one bucket at a time) vs in-memory AdamW: step time and
peak optimizer memory, in the same run.

Peak memory on CUDA is the measured `max_memory_allocated` increase over the parameters and
gradients during a step (the in-memory moments count as resident); on CPU it is the
optimizer's resident state bytes (moments, or the streaming buffers).

    python bench/optim_stream.py                           # CPU, 64 MiB of parameters
    python bench/optim_stream.py --device cuda --mib 2048 --bucket-mib 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from miles.trainer.optim_stream import StreamedAdamW


def _params(mib: int, device: torch.device) -> list[torch.nn.Parameter]:
    n = mib * 2**20 // 4
    sizes = [n // 16] * 16
    ps = [torch.nn.Parameter(torch.randn(s, device=device) * 0.01) for s in sizes]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    return ps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(opt: torch.optim.Optimizer, device: torch.device, steps: int) -> tuple[float, int]:
    opt.step()  # first step allocates state / creates files
    _sync(device)
    times = []
    peak = 0
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        if device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated(device) - base)
    return statistics.median(times), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--mib", type=int, default=64, help="parameter bytes (fp32)")
    ap.add_argument("--bucket-mib", type=float, default=16.0, help="moment bytes per bucket")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dir", default="", help="where moment files go (default: a temp dir)")
    args = ap.parse_args()
    device = torch.device(args.device)
    kw = {"lr": 1e-4, "betas": (0.9, 0.98), "eps": 1e-8, "weight_decay": 0.0}
    ref = _params(args.mib, device)
    mem = torch.optim.AdamW(ref, foreach=False, **kw)  # type: ignore[arg-type]
    t_mem, peak_mem = _measure(mem, device, args.steps)
    moments = sum(2 * p.numel() * 4 for p in ref)
    if device.type == "cuda":
        peak_mem += moments  # resident between steps, so not in the step's increase
    else:
        peak_mem = moments
    del mem, ref
    ps = _params(args.mib, device)
    with tempfile.TemporaryDirectory(dir=args.dir or None) as d:
        st = StreamedAdamW(
            ps, directory=d, bucket_bytes=int(args.bucket_mib * 2**20), device=device, **kw
        )  # type: ignore[arg-type]
        t_st, peak_st = _measure(st, device, args.steps)
        if device.type != "cuda":
            peak_st = 2 * st.bucket_bytes_max  # the two host buffers, updated in place
        buckets = len(st.buckets)
        st.close()
    print(
        f"{args.mib} MiB fp32 params on {device}; streamed: {buckets} buckets of <= {args.bucket_mib} MiB"
    )
    print(f"{'optimizer':<12}{'step s':>10}{'peak opt MiB':>14}")
    print(f"{'in-memory':<12}{t_mem:>10.3f}{peak_mem / 2**20:>14.1f}")
    print(f"{'streamed':<12}{t_st:>10.3f}{peak_st / 2**20:>14.1f}")
    print(
        json.dumps(
            {
                "device": str(device),
                "param_mib": args.mib,
                "buckets": buckets,
                "step_s_inmem": t_mem,
                "step_s_streamed": t_st,
                "step_time_ratio": t_st / t_mem,
                "peak_opt_mib_inmem": peak_mem / 2**20,
                "peak_opt_mib_streamed": peak_st / 2**20,
                "peak_memory_ratio": peak_st / peak_mem,
            }
        )
    )


if __name__ == "__main__":
    main()
