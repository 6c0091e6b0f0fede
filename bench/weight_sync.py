"""Weight-sync benchmark (CPU): time per update vs model size and bucket size, per transport.

One engine process (a real EngineActor over a tiny-architecture model) receives each
update from this process (the trainer side). Every transport is compared with its raw
channel moving the same bytes in the same bucket sizes, measured in this run:
  zmq        PUSH of the bucket frames to a second process (PULL) that copies each into its
             destination buffer (as any receiver must: zmq owns the frame memory), acked at the end
  broadcast  a bare gloo broadcast of the model's bytes, bucket by bucket, from one flat
             buffer into one flat buffer of a second process
  ucx        a bare UCXX endpoint sending the same bytes bucket by bucket (tag sends, as
             ucx_perftest's bandwidth test), into one flat buffer of a second process
  disk_delta write + read back of the full weights as files (what a naive disk sync moves)
  <t>-flat   transport <t> (zmq, ucx, broadcast, disk_delta) fed a flat export: the trainer's weights packed
             in one buffer (weightsync/flat.py: plan once, then byte ranges; what a launched
             run sends by default); raw = <t>'s
plus a host memcpy of the weights as the machine's limit. disk_delta sends a sparse
update (half the tensors change, as with a small-lr step); its GB/s counts the full
model bytes it brings up to date. Each row pairs raw and miles measurements taken back to
back (best of 3 each) and reports the median of 3 such rounds. Prints a table, then one
JSON line.

Usage: python bench/weight_sync.py [--quick] [--transports zmq,ucx,broadcast,disk_delta,zmq-flat,...]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from miles.actors.runtime.host import Host
from miles.core.schema.sync import SyncConfig
from miles.core.schema.transport import TransportConfig
from miles.models.config import ModelSpec
from miles.models.hf_io import hf_tensor_views
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.weightsync.flat import FlatWeights
from miles.weightsync.param_buffer import pack_parameters

torch.set_num_threads(1)
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def spec(hidden: int, layers: int) -> ModelSpec:
    return ModelSpec.from_hf(tiny_config("qwen3", vocab_size=4096, hidden_size=hidden, intermediate_size=3 * hidden,
                                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                         head_dim=hidden // 8))


# ------------------------------------------------------------------ child processes
def make_model(hidden: int, layers: int, seed: int, device: str = "cpu") -> torch.nn.Module:
    """The benchmark model: fp32 on the CPU; bf16 built straight on a GPU (no host-side init)."""
    if device == "cpu":
        return build_model(spec(hidden, layers), seed=seed)
    with torch.device(device):
        model = build_model(spec(hidden, layers), dtype=torch.bfloat16, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    return model


def serve_engine(hidden: int, layers: int, ready: str, device: str = "cpu") -> None:
    from miles.actors.engine import EngineActor
    from miles.actors.runtime.process import run
    from miles.core.schema.engine import EngineConfig
    from miles.engines.torch_engine import TorchEngine

    async def setup(host: Host) -> None:
        eng = TorchEngine(make_model(hidden, layers, 1, device),
                          EngineConfig(max_batch_size=2, max_seq_len=64, device=device,
                                       dtype="float32" if device == "cpu" else "bfloat16"))
        await host.add(EngineActor(eng), "engine")

    sys.exit(run(setup, cfg=TransportConfig(), run_directory=True, ready_file=ready))


def zmq_sink(ready: str) -> None:
    ctx = zmq.Context()
    pull, rep = ctx.socket(zmq.PULL), ctx.socket(zmq.REP)
    p1, p2 = pull.bind_to_random_port("tcp://127.0.0.1"), rep.bind_to_random_port("tcp://127.0.0.1")
    Path(ready).write_text(f"{p1} {p2}")
    dest = np.empty(0, dtype=np.uint8)
    while True:
        n, total = map(int, rep.recv().split())
        if dest.size != total:
            dest = np.empty(total, dtype=np.uint8)
            dest.fill(0)  # touch the pages once, as an engine's long-lived weights are
        pos = 0
        for _ in range(n):  # the receiver's write into its destination is part of the channel
            f = np.frombuffer(pull.recv(copy=False).buffer, dtype=np.uint8)
            dest[pos:pos + f.size] = f
            pos += f.size
        rep.send(b"ok")


def gloo_sink(port: int, total: int, bucket: int, reps: int) -> None:
    from torch.distributed import ProcessGroupGloo, TCPStore

    store = TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    pg = ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=60))
    dest = torch.zeros(total, dtype=torch.uint8)  # the model's bytes land in distinct memory, as in an engine
    for _ in range(reps):
        pos = 0
        for s in buckets_of(total, bucket):
            pg.broadcast(dest[pos:pos + s], 0).wait()
            pos += s
    pg.shutdown()


def _flat(total: int, device: str, fill: int) -> Any:
    """A flat byte buffer UCXX can read/write: numpy on the host, a torch CUDA tensor on a GPU."""
    if device == "cpu":
        return np.full(total, fill, dtype=np.uint8)
    return torch.full((total,), fill, dtype=torch.uint8, device=device)


def ucx_sink(ready: str, total: int, bucket: int, reps: int, device: str = "cpu") -> None:
    import ucxx

    async def serve() -> None:
        done = asyncio.Event()
        dest = _flat(total, device, 0)  # the model's bytes land in distinct memory, as in an engine

        async def handler(ep: Any) -> None:
            for _ in range(reps):
                pos = 0
                for s in buckets_of(total, bucket):
                    await ep.recv(dest[pos:pos + s])
                    pos += s
                await ep.send(np.ones(1, dtype=np.uint8))
            done.set()

        lst = ucxx.create_listener(handler)
        Path(ready).write_text(str(lst.port))
        await done.wait()
        await asyncio.sleep(0.2)
        lst.close()

    asyncio.run(serve())


def spawn(args: list[str], ready: str | None = None) -> tuple[subprocess.Popen[bytes], str]:
    p = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if ready is None:
        return p, ""
    deadline = time.monotonic() + 60
    while not os.path.exists(ready) or not Path(ready).read_text():  # written, not only created
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"child {args} failed: {p.stderr.read().decode() if p.stderr else ''}")
        time.sleep(0.02)
    return p, Path(ready).read_text()


# ------------------------------------------------------------------ raw channels
def buckets_of(total: int, bucket: int) -> list[int]:
    return [min(bucket, total - i) for i in range(0, total, bucket)]


def raw_zmq(ports: str, total: int, bucket: int, reps: int) -> float:
    p1, p2 = ports.split()
    ctx = zmq.Context.instance()
    push, req = ctx.socket(zmq.PUSH), ctx.socket(zmq.REQ)
    push.connect(f"tcp://127.0.0.1:{p1}")
    req.connect(f"tcp://127.0.0.1:{p2}")
    sizes = buckets_of(total, bucket)
    bufs = [torch.empty(s, dtype=torch.uint8).numpy() for s in sizes]
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        req.send(f"{len(sizes)} {total}".encode())
        for b in bufs:
            push.send(b, copy=False)
        req.recv()
        best = min(best, time.perf_counter() - t0)
    push.close(0)
    req.close(0)
    return total / best / 1e9


def raw_gloo(total: int, bucket: int, reps: int) -> float:
    from torch.distributed import ProcessGroupGloo, TCPStore

    sizes = buckets_of(total, bucket)
    store = TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    child, _ = spawn(["--gloo-sink", str(store.port), str(total), str(bucket), str(reps)])
    pg = ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=60))
    src = torch.ones(total, dtype=torch.uint8)  # the same bytes as the model, not one bucket resent
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        pos = 0
        for s in sizes:
            pg.broadcast(src[pos:pos + s], 0).wait()
            pos += s
        best = min(best, time.perf_counter() - t0)
    pg.shutdown()
    child.wait(30)
    return total / best / 1e9


def raw_ucx(root: Path, total: int, bucket: int, reps: int, device: str = "cpu") -> float:
    """A bare UCXX endpoint sending the model's bytes bucket by bucket (what ucx_perftest's
    tag-send bandwidth test does), acked once per pass by the receiver."""
    import ucxx

    root.mkdir(parents=True, exist_ok=True)
    ready = str(root / f"ucx-ready-{time.monotonic_ns()}")
    child, port = spawn(["--ucx-sink", ready, str(total), str(bucket), str(reps), device], ready)

    async def send() -> float:
        ep = await ucxx.create_endpoint("127.0.0.1", int(port))
        src, ack = _flat(total, device, 1), np.empty(1, dtype=np.uint8)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            pos = 0
            for s in buckets_of(total, bucket):
                await ep.send(src[pos:pos + s])
                pos += s
            await ep.recv(ack)
            best = min(best, time.perf_counter() - t0)
        await ep.close()
        return best

    best = asyncio.run(send())
    child.wait(30)
    return total / best / 1e9


def raw_disk(root: Path, total: int, bucket: int, reps: int, keep: int = 2) -> float:
    """Write the model's bytes as bucket files of a fresh directory and read them back, deleting
    directories older than the last `keep` as disk_delta does (sync.delta_keep): without the
    deletes, dirty pages pile up and later passes run at writeback speed, a moving target."""
    import shutil

    sizes = buckets_of(total, bucket)
    data = torch.ones(bucket, dtype=torch.uint8).numpy()
    best = float("inf")
    for r in range(reps + 1):  # one pass first, as disk_delta's warm-up push
        d = root / f"raw{r}"
        d.mkdir(parents=True)
        t0 = time.perf_counter()
        for i, s in enumerate(sizes):
            (d / f"b{i}").write_bytes(memoryview(data)[:s])
        for i in range(len(sizes)):
            (d / f"b{i}").read_bytes()
        if r >= keep:
            shutil.rmtree(root / f"raw{r - keep}")
        if r:
            best = min(best, time.perf_counter() - t0)
    return total / best / 1e9


def raw_channel(transport: str, zports: str, disk: Path, total: int, bucket: int, reps: int) -> float:
    if transport == "zmq":
        return raw_zmq(zports, total, bucket, reps)
    if transport == "broadcast":
        return raw_gloo(total, bucket, reps)
    if transport == "ucx":
        return raw_ucx(disk, total, bucket, reps)
    return raw_disk(disk, total, bucket, reps)


def memcpy_gbps(total: int) -> float:
    a, b = torch.ones(total, dtype=torch.uint8), torch.empty(total, dtype=torch.uint8)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return total / best / 1e9


# ------------------------------------------------------------------ miles updates
@torch.no_grad()
def perturb(model: torch.nn.Module, step: int, fraction: float) -> None:
    for i, p in enumerate(model.parameters()):
        if fraction >= 1.0 or (i + step) % round(1 / fraction) == 0:
            p.add_(1e-3)


async def miles_update(directory: str, model: torch.nn.Module, transport: str, bucket_mib: int,
                       reps: int, root: Path, device: str = "cpu", export: Callable[[], Any] | None = None) -> float:
    """Best-of-`reps` update GB/s; `export()` gives what the trainer pushes (default: its HF
    tensors one by one, re-listed every version as a trainer's export does)."""
    from miles.actors.sync import WeightSync

    host = Host(TransportConfig(), directory)
    await host.start()
    cfg = SyncConfig(transport=transport, bucket_mib=bucket_mib, pause_mode="none", step_timeout_s=60,
                     delta_dir=str(root / f"delta-{bucket_mib}"), delta_compression="auto")
    sync = WeightSync(host, cfg, ["engine"], device)
    total = sum(t.numel() * t.element_size() for t in hf_tensor_views(model).values())  # type: ignore[arg-type]
    export = export or (lambda: hf_tensor_views(model).items())  # type: ignore[arg-type]
    best = float("inf")
    try:
        version = int(time.time() * 1000) % 10**9  # fresh versions per run; the engine only wants increasing ones
        await sync.push(version, export())  # warm-up: opens channels, disk base
        for r in range(reps):
            perturb(model, r, 0.5 if transport == "disk_delta" else 1.0)
            if device != "cpu":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            await sync.push(version + 1 + r, export())
            best = min(best, time.perf_counter() - t0)
    finally:
        await sync.close()
        await host.stop()
    return total / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve-engine", nargs="+", help="hidden layers ready [device]")
    ap.add_argument("--zmq-sink")
    ap.add_argument("--gloo-sink", nargs=4, type=int)
    ap.add_argument("--ucx-sink", nargs=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--transports", default="zmq,ucx,broadcast,disk_delta,zmq-flat,ucx-flat,broadcast-flat,disk_delta-flat",
                    help="comma-separated subset (ucx is skipped, with a note, when UCXX is not installed)")
    a = ap.parse_args()
    if a.serve_engine:
        return serve_engine(int(a.serve_engine[0]), int(a.serve_engine[1]), a.serve_engine[2], *a.serve_engine[3:])
    if a.zmq_sink:
        return zmq_sink(a.zmq_sink)
    if a.gloo_sink:
        return gloo_sink(*a.gloo_sink)
    if a.ucx_sink:
        return ucx_sink(a.ucx_sink[0], *map(int, a.ucx_sink[1:4]), a.ucx_sink[4])
    transports = [t for t in a.transports.split(",") if t]
    valid = ["zmq", "ucx", "broadcast", "disk_delta", "zmq-flat", "ucx-flat", "broadcast-flat", "disk_delta-flat"]
    unknown = set(transports) - set(valid)
    if unknown:
        ap.error(f"unknown transport(s) {sorted(unknown)}; valid: {', '.join(valid)}")
    notes = []
    if {"ucx", "ucx-flat"} & set(transports) and importlib.util.find_spec("ucxx") is None:
        transports = [t for t in transports if t.removesuffix("-flat") != "ucx"]
        notes.append("ucx skipped: UCXX is not installed (pip install 'miles[ucx]')")
    sizes = [(256, 2)] if a.quick else [(256, 2), (512, 4)]
    bucket_mibs = [4] if a.quick else [4, 16]
    reps, rounds = 3, 3  # best of 3 per measurement, median of 3 paired rounds (a shared machine)
    rows, ratios = [], {}
    with tempfile.TemporaryDirectory(prefix="miles-bench-sync-") as tmp:
        root = Path(tmp)
        zsink, zports = spawn(["--zmq-sink", str(root / "zready")], str(root / "zready"))
        try:
            for hidden, layers in sizes:
                model = make_model(hidden, layers, 2)
                packed = make_model(hidden, layers, 2)
                pack_parameters(list(packed.parameters()))  # the same weights in one buffer (perturbed in place)
                flat = FlatWeights.of(hf_tensor_views(packed).items())  # type: ignore[arg-type]
                total = sum(t.numel() * t.element_size() for t in hf_tensor_views(model).values())
                ready = str(root / f"eready-{hidden}")
                eng, directory = spawn(["--serve-engine", str(hidden), str(layers), ready], ready)
                try:
                    mem = memcpy_gbps(total)
                    for mib in bucket_mibs:
                        for tr in transports:
                            # Paired rounds: raw then miles back to back, so both see the same
                            # machine load; the ratio is the median round's.
                            pairs = []
                            for k in range(rounds):
                                raw_g = raw_channel(tr.removesuffix("-flat"), zports, root / f"raw-{hidden}-{mib}-{tr}-{k}",
                                                    total, mib << 20, reps)
                                if tr.endswith("-flat"):
                                    got = asyncio.run(miles_update(directory, packed, tr.removesuffix("-flat"), mib,
                                                                   reps, root, export=lambda fw=flat: fw))
                                else:
                                    got = asyncio.run(miles_update(directory, model, tr, mib, reps, root))
                                pairs.append((got / raw_g, got, raw_g))
                            ratio, got, raw_g = sorted(pairs)[len(pairs) // 2]
                            rows.append((total / 2**20, mib, tr, got, raw_g, ratio, mem))
                            ratios[tr] = ratio  # the last row (largest model, largest bucket) is the headline
                finally:
                    eng.terminate()
                    eng.wait(10)
        finally:
            zsink.kill()
            zsink.wait(5)
    print(f"{'model MiB':>9} {'bucket MiB':>10} {'transport':>10} {'miles GB/s':>10} {'raw GB/s':>9} "
          f"{'ratio':>6} {'memcpy GB/s':>11} {'ms/update':>9}")
    for size, mib, tr, got, raw_g, ratio, mem in rows:
        print(f"{size:9.1f} {mib:10d} {tr:>10} {got:10.3f} {raw_g:9.3f} {ratio:6.2f} {mem:11.2f} "
              f"{size * 2**20 / got / 1e6:9.1f}")
    for n in notes:
        print(n)
    out: dict[str, Any] = {f"{k.replace('-', '_')}_ratio": round(v, 3) for k, v in ratios.items()}
    out.setdefault("ucx_ratio", None)
    out["goal"] = 0.8
    print(json.dumps(out))


if __name__ == "__main__":
    main()
