"""Probe: how fast can one process copy out of another process's GPU memory (CUDA IPC)?

Process A allocates a buffer and shares its IPC handle (over a pipe, msgpack; never
pickled); process B maps it and times copying it into its own memory, next to a local
device-to-device copy of the same bytes. Copy methods: `copy_` (cudaMemcpyAsync) and an
elementwise kernel (bitwise AND with -1 over int64 words: the same bytes, moved by SMs
rather than by whatever path the driver picks for a peer pointer). Whole buffer and in
buckets. CUDA events time the GPU work only.

Usage: python bench/gpu/ipc_copy_probe.py [--gb 8] [--bucket-mib 512]
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import msgpack
import torch

KEYS = ("device", "handle", "size", "offset", "ref_handle", "ref_offset", "event", "event_sync")


def owner(nbytes: int) -> None:
    buf = torch.ones(nbytes, dtype=torch.uint8, device="cuda")  # noqa: F841 - must outlive the share
    torch.cuda.synchronize()
    st = buf.untyped_storage()
    sys.stdout.buffer.write(msgpack.packb(dict(zip(KEYS, st._share_cuda_(), strict=True))))
    sys.stdout.buffer.flush()
    sys.stdin.read()  # hold the buffer until the reader is done


def timed(fn, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=8)
    ap.add_argument("--bucket-mib", type=int, default=512)
    ap.add_argument("--owner", type=int)
    a = ap.parse_args()
    if a.owner:
        return owner(a.owner)
    n = int(a.gb * 1e9) // 8 * 8
    p = subprocess.Popen([sys.executable, __file__, "--owner", str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdin is not None
    h = msgpack.Unpacker()
    while True:
        h.feed(p.stdout.read1(65536))
        got = list(h)
        if got:
            break
    hd = got[0]
    local = torch.ones(n, dtype=torch.uint8, device="cuda")  # initializes CUDA here before mapping
    st = torch.UntypedStorage._new_shared_cuda(*(hd[k] for k in KEYS))
    remote = torch.empty(0, dtype=torch.uint8, device="cuda").set_(st, 0, (n,))
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    bk = a.bucket_mib << 20
    cuts = [(i, min(i + bk, n)) for i in range(0, n, bk)]

    def kernel_copy(src: torch.Tensor, d: torch.Tensor) -> None:
        torch.bitwise_and(src.view(torch.int64), -1, out=d.view(torch.int64))

    rows = {}
    for name, src in (("local", local), ("ipc", remote)):
        rows[f"{name}_copy_whole"] = timed(lambda s=src: dst.copy_(s))
        rows[f"{name}_copy_buckets"] = timed(lambda s=src: [dst[lo:hi].copy_(s[lo:hi]) for lo, hi in cuts])
        rows[f"{name}_kernel_whole"] = timed(lambda s=src: kernel_copy(s, dst))
        rows[f"{name}_kernel_buckets"] = timed(lambda s=src: [kernel_copy(s[lo:hi], dst[lo:hi]) for lo, hi in cuts])
    assert torch.equal(dst[:1024], local[:1024])
    p.stdin.close()
    p.wait(30)
    gbps = {k: round(n / v / 1e9, 1) for k, v in rows.items()}
    print(f"{'method':>22} {'GB/s':>8} {'vs local copy_':>15}")
    for k, v in gbps.items():
        print(f"{k:>22} {v:8.1f} {v / gbps['local_copy_whole']:15.2f}")
    print(json.dumps({"gb": n / 1e9, "bucket_mib": a.bucket_mib, "gbps": gbps,
                      "ipc_copy_vs_local": round(gbps["ipc_copy_buckets"] / gbps["local_copy_whole"], 3),
                      "ipc_kernel_vs_local": round(gbps["ipc_kernel_buckets"] / gbps["local_copy_whole"], 3)}))


if __name__ == "__main__":
    main()
