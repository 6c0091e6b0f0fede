"""Weight sync over miles' `broadcast` channel between two processes (GPU 0 -> GPU 1 on NCCL).

The sender packs HF-named bf16 tensors into fixed-size buckets (`iter_buckets` + the
channel's `prepare`), broadcasts each bucket, and the receiver gets it into its
pre-allocated staging buffer (`BroadcastReceiver.recv`), reassembles chunked tensors
(`Reassembler`, as the engine actor does) and commits a copy into its destination
tensors. Baseline in the same run, on a second communicator over the same GPU pair: a raw
`torch.distributed.broadcast` of the same bytes as one flat buffer, and as the same
number of bucket-sized pieces without packing. Every byte is checked after the first update.

The per-bucket layout headers are computed on the receiver from its own destination
shapes (the real run sends them as small msgpack messages over the actor wire; not timed).

Usage: python bench/multi_gpu/weight_sync_nccl.py --device cuda --sizes-gb 0.5 2 8 \
           --buckets-mib 128 512 1024 --out result.json       (last line: JSON)
       --device cpu uses gloo and --klass tiny shapes (a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from workers import run_workers  # this folder is on sys.path: the scripts run directly

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synthetic_weights as sw  # noqa: E402

from miles.core.errors import SyncError  # noqa: E402
from miles.core.ports import group_port  # noqa: E402
from miles.core.schema.sync import SyncConfig  # noqa: E402
from miles.transport.bulk.base import Layout, LocalWeights  # noqa: E402
from miles.transport.bulk.broadcast import BroadcastReceiver, BroadcastSender  # noqa: E402
from miles.transport.bulk.buckets import Reassembler, iter_buckets  # noqa: E402
from miles.weightsync.flat import FlatWeights  # noqa: E402


def _packed(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The same tensors as views of one buffer, in order."""
    return list(FlatWeights.copy_of(named)) if named else []


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _bcast_json(obj: Any, dev: torch.device) -> Any:
    """Rank 0 sends `obj` as JSON bytes over the group (no pickle); other ranks return it."""
    if obj is not None:
        raw = json.dumps(obj).encode()
        n = torch.tensor([len(raw)], dtype=torch.int64, device=dev)
    else:
        n = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.broadcast(n, 0)
    buf = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(dev) if obj is not None
           else torch.empty(int(n.item()), dtype=torch.uint8, device=dev))
    dist.broadcast(buf, 0)
    return obj if obj is not None else json.loads(bytes(buf.cpu().numpy()).decode())


def _barrier(dev: torch.device) -> None:
    """Both ranks line up, with all their device work done."""
    _sync(dev)
    dist.all_reduce(torch.ones(1, device=dev))
    _sync(dev)


def _agree(seconds: float, dev: torch.device) -> float:
    """The slower rank's time: an update is done when both sides are."""
    t = torch.tensor([seconds], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class Worker:
    def __init__(self, a: argparse.Namespace, rank: int) -> None:
        self.a, self.rank = a, rank
        if a.device == "cuda":
            torch.cuda.set_device(rank)
            self.dev = torch.device("cuda", rank)
        else:
            self.dev = torch.device("cpu")
        backend = "nccl" if a.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{a.port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        self.max_bucket = max(a.buckets_mib) << 20
        self.tx: BroadcastSender | None = None
        self.rx: BroadcastReceiver | None = None

    async def open_channel(self) -> None:
        """Open miles' channel once (its staging buffers sized for the largest bucket)."""
        port = torch.zeros(1, dtype=torch.int64, device=self.dev)
        if self.rank == 0:
            cfg = SyncConfig(transport="broadcast", bucket_mib=max(self.a.buckets_mib))
            self.tx = BroadcastSender(cfg)
            self.tx.device = self.dev
            infos = await self.tx.open(["engine0"])
            port[0] = int(infos[0]["port"])
            info = infos[0]
        dist.broadcast(port, 0)  # the one thing the receiver needs from the sender's open info
        if self.rank == 1:
            info = {"backend": "nccl" if self.dev.type == "cuda" else "gloo", "addr": "127.0.0.1",
                    "port": int(port.item()), "rank": 1, "world": 2, "timeout_s": 120.0}
            self.rx = BroadcastReceiver(info, self.max_bucket)
            await self.rx.open()
        else:
            assert self.tx is not None
            await self.tx.connected()

    async def miles_update(self, src: list[tuple[str, torch.Tensor]], dest: dict[str, torch.Tensor],
                           headers: list[dict[str, Any]], bucket_bytes: int, version: int) -> float:
        _barrier(self.dev)
        t0 = time.perf_counter()
        if self.tx is not None:
            self.tx.bucket_bytes = bucket_bytes
            for seq, bucket in enumerate(iter_buckets(src, bucket_bytes)):
                # The header (which runs go direct, which are packed) travels ahead of the bucket,
                # as the BulkRecv control message does in a real sync.
                _bcast_json(self.tx.prepare(version, seq, bucket), self.dev)
                await self.tx.transmit()
        else:
            assert self.rx is not None
            def slot(name: str) -> torch.Tensor:
                if name not in dest:  # a chunk of a larger tensor: not a slot of its own (as in the engine)
                    raise SyncError(f"no slot {name!r}")
                return dest[name]
            local = LocalWeights(version - 1, dest.__getitem__, slot if self.a.packed else None)
            reasm = Reassembler()
            for _ in headers:
                h = _bcast_json(None, self.dev)
                for name, t in await self.rx.recv(h, local):
                    done = reasm.add(name, t)
                    if done is not None and done[1].data_ptr() != dest[done[0]].data_ptr():
                        dest[done[0]].copy_(done[1])  # the commit copy, before the buffer is reused
            if reasm.incomplete():
                raise RuntimeError(f"chunks missing for {reasm.incomplete()[:3]}")
        _sync(self.dev)
        return _agree(time.perf_counter() - t0, self.dev)

    def raw_update(self, flat: torch.Tensor, piece: int) -> float:
        _barrier(self.dev)
        t0 = time.perf_counter()
        for off in range(0, flat.numel(), piece):
            dist.broadcast(flat[off:off + piece], 0)
        _sync(self.dev)
        return _agree(time.perf_counter() - t0, self.dev)

    async def run_size(self, gb: float) -> dict[str, Any]:
        a = self.a
        spec = sw.layout(int(gb * 1e9), a.klass)
        nbytes = sw.nbytes(spec)
        src = list(sw.make_source(spec, self.dev)) if self.rank == 0 else []
        dest = sw.make_destination(spec, self.dev) if self.rank == 1 else {}
        if a.packed:
            src, dest = _packed(src), dict(_packed(list(dest.items())))
        res: dict[str, Any] = {"target_gb": gb, "bytes": nbytes, "tensors": len(spec), "buckets": {}}
        version = 1
        for mib in a.buckets_mib:
            bb = mib << 20
            headers = [{"layout": Layout.of(b).to_wire()} for b in iter_buckets(dest.items(), bb)]
            times = []
            for r in range(a.repeats + 1):
                dt = await self.miles_update(src, dest, headers, bb, version)
                version += 1
                if r == 0:  # warm-up update: check every byte landed where it belongs
                    bad = sw.mismatches(spec, dest) if self.rank == 1 else []
                    flag = torch.tensor([len(bad)], device=self.dev)
                    dist.broadcast(flag, 1)
                    if int(flag.item()):
                        raise RuntimeError(f"{int(flag.item())} tensors differ after sync, e.g. {bad[:3]}")
                    for t in dest.values():
                        t.zero_()
                else:
                    times.append(dt)
            res["buckets"][str(mib)] = {"n_buckets": len(headers) if self.rank == 1 else None,
                                        "seconds": times, "verified": True}
        del src, dest
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
        if self.rank == 0:
            flat.fill_(7)
        for label, piece in [("raw_flat", nbytes)] + [(f"raw_pieces_{m}", m << 20) for m in a.buckets_mib]:
            times = [self.raw_update(flat, piece) for _ in range(a.repeats + 1)][1:]
            res[label] = {"seconds": times}
        del flat
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
        return res

    async def main(self) -> list[dict[str, Any]]:
        await self.open_channel()
        out = [await self.run_size(gb) for gb in self.a.sizes_gb]
        if self.tx is not None:
            await self.tx.close()
        if self.rx is not None:
            await self.rx.close()
        dist.destroy_process_group()
        return out


def _ucxx_status() -> dict[str, Any]:
    try:
        import ucxx  # type: ignore[import-not-found]  # noqa: F401
    except ImportError as exc:
        return {"available": False, "reason": f"ucxx not importable here ({exc}); it was not carried "
                "to the device, so the UCXX GPU-to-GPU comparison was not run"}
    return {"available": True, "reason": "importable but not measured by this script"}


def summarize(sizes: list[dict[str, Any]], buckets: list[int]) -> dict[str, Any]:
    rows = []
    for s in sizes:
        n = s["bytes"]
        raw = min(s["raw_flat"]["seconds"])
        for mib in buckets:
            b = s["buckets"][str(mib)]
            t = min(b["seconds"])
            pieces = min(s[f"raw_pieces_{mib}"]["seconds"])
            rows.append({"target_gb": s["target_gb"], "bytes": n, "bucket_mib": mib, "n_buckets": b["n_buckets"],
                         "update_s": round(t, 5), "update_s_all": [round(x, 5) for x in b["seconds"]],
                         "gb_s": round(n / t / 1e9, 2), "raw_flat_gb_s": round(n / raw / 1e9, 2),
                         "raw_pieces_gb_s": round(n / pieces / 1e9, 2),
                         "ratio_vs_raw_flat": round(raw / t, 3), "ratio_vs_raw_pieces": round(pieces / t, 3),
                         "verified": b["verified"]})
    return {"rows": rows, "min_ratio_vs_raw_flat": min(r["ratio_vs_raw_flat"] for r in rows),
            "goal_ratio": 0.8, "goal_met": all(r["ratio_vs_raw_flat"] >= 0.8 for r in rows)}


def parent(a: argparse.Namespace) -> None:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = Path(a.out).with_suffix(".parts")
    out.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, __file__, "--device", a.device, "--klass", a.klass, "--repeats", str(a.repeats),
            "--port", str(group_port()), "--parts", str(out), "--sizes-gb", *map(str, a.sizes_gb),
            "--buckets-mib", *map(str, a.buckets_mib), *(["--packed"] if a.packed else [])]
    run_workers([[*base, "--role", str(r)] for r in range(2)], env, a.timeout, "weight-sync workers")
    sizes = json.loads((out / "rank1.json").read_text())
    summary = summarize(sizes, a.buckets_mib)
    print(f"{'model GB':>8s} {'bucket MiB':>10s} {'buckets':>7s} {'update s':>9s} {'GB/s':>7s} "
          f"{'raw GB/s':>8s} {'ratio':>6s} {'raw pieces GB/s':>15s}")
    for r in summary["rows"]:
        print(f"{r['bytes'] / 1e9:8.3f} {r['bucket_mib']:10d} {r['n_buckets']:7d} {r['update_s']:9.4f} "
              f"{r['gb_s']:7.1f} {r['raw_flat_gb_s']:8.1f} {r['ratio_vs_raw_flat']:6.2f} {r['raw_pieces_gb_s']:15.1f}")
    result = {"bench": "weight_sync_nccl", "device": a.device,
              "backend": "nccl" if a.device == "cuda" else "gloo", "channel": "miles broadcast (bucketed)", "packed": a.packed,
              "sender_gpu": 0 if a.device == "cuda" else None, "receiver_gpu": 1 if a.device == "cuda" else None,
              "repeats": a.repeats, "timing": "best of repeats after one verified warm-up update; the slower rank's "
              "time from a barrier to its last device op (receiver includes the commit copy)",
              "ucxx": _ucxx_status(), **summary}
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--sizes-gb", type=float, nargs="+", default=[0.004, 0.012])
    ap.add_argument("--buckets-mib", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--klass", default="", help="shape class of synthetic weights; default: by size (tiny on cpu)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--packed", action="store_true",
                    help="as a flat-export trainer and a torch engine hold weights: the source in one buffer "
                         "(runs go unpacked) and the destination as staging slots in one buffer laid out the "
                         "same (buckets land in place; commit is a swap, so no commit copy)")
    ap.add_argument("--timeout", type=float, default=200.0)
    ap.add_argument("--out", default="weight_sync_nccl.json")
    ap.add_argument("--role", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--parts", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not a.klass and a.device == "cpu":
        a.klass = "tiny"
    if a.role < 0:
        parent(a)
        return
    res = asyncio.run(Worker(a, a.role).main())
    Path(a.parts, f"rank{a.role}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
