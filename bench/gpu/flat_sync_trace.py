"""Probe: where the time of one flat cuda_ipc weight update goes (trainer + engine process, one GPU).

The engine process runs a tracing subclass of the engine actor that timestamps (system-wide
monotonic clock, comparable across processes) each flat range's arrival, its copy enqueue,
the final synchronize and the commit, and times the copies on the GPU with CUDA events.
The trainer side timestamps the push. Per phase, the median over `--reps` updates:

  to_first    push start -> first range reaches the engine handler
  arrivals    first -> last range arrival (message handling, serial on the engine)
  gpu_copy    first copy start -> last copy end, on the GPU (CUDA events)
  copy_tail   last arrival -> copies synchronized
  to_commit   copies synchronized -> commit reaches the engine (reply + commit ask)
  commit      commit handler, of which: engine_commit (the engine's commit call), apply
              (the stager's swap), check (the completeness check)
  to_return   commit done -> push returns
  (trainer side) prepare0: the first range's prepare (synchronizes the trainer's stream)
  health_rtt  one actor round trip (a Health ask), for scale

Usage: python bench/gpu/flat_sync_trace.py [--gb 8] [--bucket-mib 512] [--reps 7]
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import weight_sync as ws  # noqa: E402  (bench/ helpers: the model and its sizes)

from miles.actors.runtime.host import Host  # noqa: E402
from miles.core.schema.sync import SyncConfig  # noqa: E402
from miles.core.schema.transport import TransportConfig  # noqa: E402
from miles.models.hf_io import hf_tensor_views  # noqa: E402
from miles.weightsync.flat import FlatWeights  # noqa: E402
from miles.weightsync.param_buffer import pack_parameters  # noqa: E402

HIDDEN, LAYER_BYTES = 2048, 100_663_296


def serve(layers: int, ready: str, trace: str) -> None:
    from miles.actors.engine import EngineActor
    from miles.actors.messages import Commit
    from miles.actors.runtime.actor import handler
    from miles.actors.runtime.process import run
    from miles.core.schema.engine import EngineConfig
    from miles.engines.torch_engine import TorchEngine
    from miles.weightsync.messages import FlatRange

    class Tracing(EngineActor):
        marks: dict[str, Any] = {}
        cur: dict[str, float] = {}

        def __init__(self, engine: Any) -> None:
            super().__init__(engine)
            for obj, attr in ((engine, "commit"), (engine.weights.stager, "apply"), (engine.weights.stager, "check_complete")):
                setattr(obj, attr, self._timed(getattr(obj, attr), attr))

        def _timed(self, fn: Any, key: str) -> Any:
            if asyncio.iscoroutinefunction(fn):
                async def aw(*args: Any) -> Any:
                    t = time.monotonic()
                    try:
                        return await fn(*args)
                    finally:
                        self.cur[key] = time.monotonic() - t
                return aw

            def w(*args: Any) -> Any:
                t = time.monotonic()
                try:
                    return fn(*args)
                finally:
                    self.cur[key] = time.monotonic() - t
            return w

        @handler(FlatRange)
        async def flat_range(self, msg: FlatRange) -> int:
            m = self.marks.setdefault(msg.version, {"arrive": [], "events": []})
            m["arrive"].append(time.monotonic())
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            n = await super().flat_range(msg)  # the last range synchronizes inside
            ev1.record()
            m["events"].append((ev0, ev1))
            m["done"] = time.monotonic()
            return n

        @handler(Commit)
        async def commit(self, msg: Commit) -> None:
            m = self.marks.get(msg.version, {})
            m["commit_in"] = time.monotonic()
            await super().commit(msg)
            m["commit_out"] = time.monotonic()
            if m.get("events"):
                torch.cuda.synchronize()
                first, last = m["events"][0][0], m["events"][-1][1]
                rec = {"version": msg.version, "arrive": m["arrive"], "done": m["done"],
                       "commit_in": m["commit_in"], "commit_out": m["commit_out"], **dict(self.cur),
                       "gpu_copy_s": first.elapsed_time(last) / 1e3}
                with open(trace, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            self.marks.pop(msg.version, None)

    async def setup(host: Host) -> None:
        eng = TorchEngine(ws.make_model(HIDDEN, layers, 1, "cuda"),
                          EngineConfig(max_batch_size=2, max_seq_len=64, device="cuda", dtype="bfloat16"))
        await host.add(Tracing(eng), "engine")

    sys.exit(run(setup, cfg=TransportConfig(), run_directory=True, ready_file=ready))


async def drive(directory: str, fw: FlatWeights, mib: int, reps: int) -> list[dict[str, float]]:
    from miles.actors.sync import WeightSync

    host = Host(TransportConfig(), directory)
    await host.start()
    sync = WeightSync(host, SyncConfig(transport="cuda_ipc", bucket_mib=mib, pause_mode="none", step_timeout_s=60),
                      ["engine"], "cuda")
    out = []
    prep = sync.sender.prepare_flat
    first: dict[int, float] = {}

    def timed_prepare(version: int, seq: int, *args: Any) -> Any:
        t = time.monotonic()
        try:
            return prep(version, seq, *args)
        finally:
            if seq == 0:
                first[version] = time.monotonic() - t
    sync.sender.prepare_flat = timed_prepare  # type: ignore[method-assign]
    from miles.actors.messages import Health

    rtt = []
    for _ in range(50):  # the actor wire's round trip, for scale
        t = time.monotonic()
        await host.ref("engine").ask(Health(), timeout=10)
        rtt.append(time.monotonic() - t)
    try:
        base = int(time.time() * 1000) % 10**9
        for r in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.monotonic()
            rep = await sync.push(base + r, fw)
            out.append({"version": base + r, "start": t0, "end": time.monotonic(), "buckets": rep.buckets,
                        "prepare0": first.get(base + r, float("nan")), "health_rtt": sorted(rtt)[25]})
    finally:
        await sync.close()
        await host.stop()
    return out[1:]  # the first opens the channel and sends the plan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=8)
    ap.add_argument("--bucket-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--serve", nargs=3)
    a = ap.parse_args()
    if a.serve:
        return serve(int(a.serve[0]), a.serve[1], a.serve[2])
    layers = max(1, round(a.gb * 1e9 / LAYER_BYTES))
    with tempfile.TemporaryDirectory(prefix="miles-flat-trace-") as tmp:
        ready, trace = os.path.join(tmp, "ready"), os.path.join(tmp, "trace.jsonl")
        p = subprocess.Popen([sys.executable, __file__, "--serve", str(layers), ready, trace])
        try:
            while not os.path.exists(ready):
                if p.poll() is not None:
                    raise SystemExit("engine process failed to start")
                time.sleep(0.05)
            model = ws.make_model(HIDDEN, layers, 2, "cuda")
            pack_parameters(list(model.parameters()))
            fw = FlatWeights.of(hf_tensor_views(model).items())  # type: ignore[arg-type]
            pushes = asyncio.run(drive(Path(ready).read_text(), fw, a.bucket_mib, a.reps))
            time.sleep(0.5)
            eng = {r["version"]: r for r in map(json.loads, Path(trace).read_text().splitlines())}
        finally:
            p.terminate()
            p.wait(30)
    phases: dict[str, list[float]] = {}
    for pu in pushes:
        e = eng[pu["version"]]
        row = {"total": pu["end"] - pu["start"], "to_first": e["arrive"][0] - pu["start"],
               "arrivals": e["arrive"][-1] - e["arrive"][0], "gpu_copy": e["gpu_copy_s"],
               "copy_tail": e["done"] - e["arrive"][-1], "to_commit": e["commit_in"] - e["done"],
               "commit": e["commit_out"] - e["commit_in"], "engine_commit": e.get("commit", float("nan")),
               "apply": e.get("apply", float("nan")), "check": e.get("check_complete", float("nan")),
               "to_return": pu["end"] - e["commit_out"], "prepare0": pu["prepare0"], "health_rtt": pu["health_rtt"]}
        for k, v in row.items():
            phases.setdefault(k, []).append(v * 1e3)
    med = {k: round(sorted(v)[len(v) // 2], 3) for k, v in phases.items()}
    gbps = fw.plan.nbytes / (med["total"] / 1e3) / 1e9
    print(f"{fw.plan.nbytes / 1e9:.2f} GB in {pushes[0]['buckets']} buckets of {a.bucket_mib} MiB, {gbps:.0f} GB/s")
    print(f"{'phase':>10} {'ms (median)':>12}")
    for k, v in med.items():
        print(f"{k:>10} {v:12.3f}")
    print(json.dumps({"gb": round(fw.plan.nbytes / 1e9, 3), "bucket_mib": a.bucket_mib,
                      "buckets": pushes[0]["buckets"], "gbps": round(gbps, 1), "phases_ms": med}))


if __name__ == "__main__":
    main()
