"""Where one disk_delta update's time goes (CPU), against the raw channel's file write + read.

In one process, no actors: the per-entry work of transport/bulk/disk_delta.py for one update of
bench/weight_sync.py's 64 MiB model with half the tensors changed (trainer side: a digest of
every entry; file write and base copy of the changed ones; engine side: the changed entries
from the file into their staging slots, checked by digest, the copy of unchanged ones from the
live weights; the delete of the version before last), and the raw channel writing and reading
back the full bytes as a file. Changed entries (uncompressed: `full+raw`) go three ways, each
update all three, in rotating order:
  buffered  session 15's receiver: the file read into a reused buffer, each entry copied into its
            slot, then hashed; the sender writes an entry, then copies it as the next base
  direct    this session's receiver: each entry read from the file straight into its slot in
            1 MiB chunks, each chunk hashed as it lands (cache-hot); the sender as `buffered`
  chunked   `direct`, and the sender copies each 1 MiB chunk into the next base and writes the
            file from that copy while it is in cache
`rm` (deleting the version before last) runs beside the next push since session 17: printed, not
in the sums. Medians of `--reps` updates, in ms. What the bench's ratio has beyond these is the
per-update fixed cost (stage asks to the engine actor per bucket, index.json, the directory
rename, the commit). Results: bench/results/weight_sync_disk_delta_cpu*.txt. Last line: one
JSON object.

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
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
import weight_sync as ws  # noqa: E402  (bench/ is not a package)

from miles.models.hf_io import hf_tensor_views  # noqa: E402
from miles.transport.bulk.delta_codec import as_bytes, digest  # noqa: E402

VARIANTS = ("buffered", "direct", "chunked")  # see the module doc
CHUNK = 1 << 20


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
            for variant in VARIANTS[rep % 3:] + VARIANTS[:rep % 3]:
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
                        if variant == "chunked":
                            with timer("s_keep+write", t):
                                for c in range(0, n.numel(), CHUNK):
                                    part = keep[i][c:c + CHUNK].copy_(n[c:c + CHUNK])
                                    f.write(memoryview(part.numpy()))
                        else:
                            with timer("s_write", t):
                                f.write(memoryview(n.numpy()))
                            with timer("s_keep", t):
                                keep[i].copy_(n)
                        changed.append(i)
                with open(d / "b.bin", "rb", buffering=0) as f:
                    if variant == "buffered":
                        with timer("r_read", t):
                            f.readinto(memoryview(buf.numpy()))
                    pos = 0
                    for i, n in enumerate(views):
                        if i in changed:
                            k = n.numel()
                            if variant == "buffered":
                                with timer("r_copy", t):
                                    slot[i].copy_(buf[pos:pos + k])
                                with timer("r_digest", t):
                                    digest(slot[i])
                            else:
                                with timer("r_read+digest", t):
                                    h = xxhash.xxh3_128()
                                    view = slot[i].numpy().data
                                    for c in range(0, k, CHUNK):
                                        got = f.readinto(view[c:c + CHUNK])
                                        h.update(view[c:c + got])
                                    h.hexdigest()
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
        ours = sum(v for k, v in med.items() if k.startswith(variant + ":") and not k.endswith(":rm"))
        print(f"disk_delta phases ({variant}) {ours:.1f} ms vs raw {raw:.1f} ms: ratio {raw / ours:.2f} "
              "(before RPC, index, commit; rm apart)")
        out[f"ratio_{variant}"] = round(raw / ours, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
