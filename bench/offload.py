"""Trainer offload: one-block offload/reload GB/s against a plain host<->device copy of the
same bytes measured in the same run.

The state is a realistic mix: many parameters of uneven sizes plus their AdamW moments
(made by one optimizer step). The baseline copies one buffer of the same size between the
device and a pinned host buffer (plain host memory on CPU). Ratios are medians over
interleaved repeats: offload_ratio = copy D2H seconds / offload seconds, likewise reload.

    python bench/offload.py                      # CPU, 256 MiB
    python bench/offload.py --device cuda --mib 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from miles.trainer.offload import FlatOffload, trainer_state_tensors


def _state(mib: int, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """~mib MiB in params + Adam moments (params are a third of it), uneven tensor sizes."""
    per = mib * 2**20 // 3 // 4  # fp32 elements of parameters
    g = torch.Generator().manual_seed(0)
    sizes, left = [], per
    while left > 0:
        n = min(left, int(torch.randint(1, 8, (1,), generator=g)) * max(per // 64, 1))
        sizes.append(n)
        left -= n
    mod = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(n, device=device) * 0.01) for n in sizes]
        + [torch.nn.Parameter(torch.zeros(64, device=device)) for _ in range(64)]  # small ones
    )
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-3)
    for p in mod.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return mod, opt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--mib", type=int, default=256, help="total state size")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    mod, opt = _state(args.mib, device)
    fo = FlatOffload(lambda: trainer_state_tensors([mod], [opt]), device)
    fo.offload([mod])  # builds the block (one-time per-tensor pack)
    fo.reload()
    n = fo.nbytes
    pin = device.type == "cuda"
    dev_buf = torch.empty(n, dtype=torch.uint8, device=device)
    host_buf = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
    d2h, h2d, off, rel = [], [], [], []
    for _ in range(args.repeats):
        _sync(device)
        t0 = time.perf_counter()
        host_buf.copy_(dev_buf, non_blocking=True)
        _sync(device)
        d2h.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dev_buf.copy_(host_buf, non_blocking=True)
        _sync(device)
        h2d.append(time.perf_counter() - t0)
        off.append(fo.offload([mod]))
        rel.append(fo.reload())
    med = statistics.median
    gb = n / 1e9
    rows = [
        ("copy D2H (baseline)", med(d2h)),
        ("offload", med(off)),
        ("copy H2D (baseline)", med(h2d)),
        ("reload", med(rel)),
    ]
    print(
        f"state {n / 2**20:.0f} MiB in {len(fo._tensors)} tensors on {device} (pinned host: {pin})"
    )
    print(f"{'op':<22}{'seconds':>10}{'GB/s':>10}")
    for name, s in rows:
        print(f"{name:<22}{s:>10.4f}{gb / s:>10.2f}")
    result = {
        "device": str(device),
        "state_mib": n / 2**20,
        "tensors": len(fo._tensors),
        "offload_gbps": gb / med(off),
        "reload_gbps": gb / med(rel),
        "copy_d2h_gbps": gb / med(d2h),
        "copy_h2d_gbps": gb / med(h2d),
        "offload_ratio": med(d2h) / med(off),
        "reload_ratio": med(h2d) / med(rel),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
