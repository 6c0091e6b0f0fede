"""Where one disk_delta update's time goes (CPU), against the raw channel's file write + read.

In one process, no actors: the per-entry work of transport/bulk/disk_delta.py for one update of
bench/weight_sync.py's 64 MiB model with half the tensors changed (trainer side: a digest of
every entry; file write and base copy of the changed ones; engine side: the file read into a
reused buffer, the changed entries into their staging slots and their digest, the copy of
unchanged ones from the live weights; the delete of the version before last), and the raw
channel writing and reading back the full bytes as a file. Changed entries go two ways, each
update both, in alternating order: `bytes` (what disk_delta writes when it does not compress:
the bytes themselves, copied into the slot) and `xor` (what it wrote before session 15: their
XOR with the base, computed and checked for zeros on the sender, XORed back on the receiver).
Medians of `--reps` updates, in ms. What the bench's ratio has beyond these is the per-update
fixed cost (stage asks to the engine actor per bucket, index.json, the directory rename, the
commit). Results: bench/results/weight_sync_disk_delta_cpu*.txt. Last line: one JSON object.

Usage: python bench/disk_delta_phases.py [--reps 9]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import weight_sync as ws  # noqa: E402  (bench/ is not a package)

from miles.models.hf_io import hf_tensor_views  # noqa: E402
from miles.transport.bulk.delta_codec import as_bytes, digest  # noqa: E402

VARIANTS = ("bytes", "xor")  # how a changed entry travels: now / before session 15


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = ws.make_model(512, 4, 2)
    views = [as_bytes(t) for t in hf_tensor_views(model).values()]  # type: ignore[arg-type]
    total = sum(v.numel() for v in views)
    base = [v.clone() for v in views]  # both sides' copy of the last version
    keep = [v.clone() for v in views]  # the sender's spare
    slot = [v.clone() for v in views]  # the engine's staging
    sums = [digest(v) for v in views]
    scratch = torch.empty(max(v.numel() for v in views), dtype=torch.uint8)
    buf = torch.empty(total, dtype=torch.uint8)
    times: dict[str, list[float]] = {}
    root = Path(tempfile.mkdtemp(prefix="miles-delta-phases-"))

    @contextlib.contextmanager
    def timer(key: str, acc: dict[str, float]) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0

    try:
        changed: list[int] = []
        for rep in range(a.reps):
            ws.perturb(model, rep, 0.5)
            for variant in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):
                t: dict[str, float] = {}
                d = root / f"v{rep}-{variant}"
                d.mkdir()
                changed = []
                with open(d / "b.bin", "wb") as f:
                    for i, n in enumerate(views):
                        with timer("s_digest", t):
                            s = digest(n)
                        if s == sums[i]:
                            continue
                        if variant == "xor":
                            with timer("s_xor", t):
                                p = torch.bitwise_xor(n, base[i], out=scratch[:n.numel()])
                                p.any()  # encode's check for an all-zero XOR
                        else:
                            p = n
                        with timer("s_write", t):
                            f.write(memoryview(p.numpy()))
                        with timer("s_keep", t):
                            keep[i].copy_(n)
                        changed.append(i)
                with timer("r_read", t), open(d / "b.bin", "rb", buffering=0) as f:
                    f.readinto(memoryview(buf.numpy()))
                pos = 0
                for i, n in enumerate(views):
                    if i in changed:
                        k = n.numel()
                        if variant == "xor":
                            with timer("r_xor", t):
                                torch.bitwise_xor(buf[pos:pos + k], base[i], out=slot[i])
                        else:
                            with timer("r_copy", t):
                                slot[i].copy_(buf[pos:pos + k])
                        with timer("r_digest", t):
                            digest(slot[i])
                        pos += k
                    else:
                        with timer("r_copy_same", t):
                            slot[i].copy_(base[i])
                if rep >= 2:
                    with timer("rm", t):
                        shutil.rmtree(root / f"v{rep - 2}-{variant}")
                for k, v in t.items():
                    times.setdefault(f"{variant}:{k}", []).append(v)
            for i in changed:
                base[i].copy_(views[i])
                sums[i] = digest(views[i])
            t = {}
            rd = root / f"raw{rep}"
            rd.mkdir()
            with timer("raw_write", t), open(rd / "b", "wb") as f:
                for n in views:
                    f.write(memoryview(n.numpy()))
            with timer("raw_read", t):
                (rd / "b").read_bytes()
            if rep >= 2:
                shutil.rmtree(root / f"raw{rep - 2}")
            for k, v in t.items():
                times.setdefault(k, []).append(v)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    moved = sum(views[i].numel() for i in changed)
    print(f"model {total / 2**20:.0f} MiB, {len(changed)} of {len(views)} tensors ({moved / 2**20:.0f} MiB) changed "
          f"per update; medians of {a.reps}, ms")
    for k, v in med.items():
        print(f"  {k:18s} {v:7.1f}")
    raw = med["raw_write"] + med["raw_read"]
    out: dict[str, Any] = {"phases_ms": {k: round(v, 1) for k, v in med.items()}}
    for variant in VARIANTS:
        ours = sum(v for k, v in med.items() if k.startswith(variant + ":"))
        print(f"disk_delta phases ({variant}) {ours:.1f} ms vs raw {raw:.1f} ms: ratio {raw / ours:.2f} "
              "(before RPC, index, commit)")
        out[f"ratio_{variant}"] = round(raw / ours, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
