"""A/B (CPU): a gathered flat export pushed by the gathered coordinator vs as a one-rank sharded sync.

Since session 17 `GatheredSync.push` sends a flat export over zmq or ucx through
`ShardedCoordinator` with one rank (weightsync/one_rank.py), since session 19 over broadcast too
from a CPU trainer; `GatheredCoordinator` still has its flat path (disk_delta, cuda_ipc and NCCL
broadcast use it; NCCL's one-rank push, one collective per bucket to every engine, is measured here
with --device cuda though not routed yet). Both run here in one process against one engine process
(a real EngineActor, as bench/weight_sync.py serves it), interleaved push by push (alternating which
goes first) so both see the same machine load: A = `sync.coordinator.push` (the gathered flat path,
what every flat push took before), B = the one-rank sharded push (what `sync.push` runs). A push
after each switch of path reopens the channel and is not timed. Reports the median and best ms per
push. `--cut bytes` gives the one-rank plan the multi-rank plan's bucket cut (every bucket_mib
across tensors), what made its broadcast push slower before session 19.

Run broadcast in its own invocation: after ucx in the same engine process, broadcast's group
setup or a push has hung (the engine stopped answering, session 19; seen with and without the
session's changes).

    python bench/weight_sync_one_rank.py [--transports zmq,ucx] [--hidden 512 --layers 4] [--pushes 15]
    python bench/weight_sync_one_rank.py --device cuda --hidden 2048 --layers 8 --transports zmq,ucx,broadcast  # a GPU

Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_sync import make_model, spawn  # noqa: E402 - the engine process and model of the main sync bench

from miles.actors.runtime.host import Host  # noqa: E402
from miles.core.schema.sync import SyncConfig  # noqa: E402
from miles.core.schema.transport import TransportConfig  # noqa: E402
from miles.models.hf_io import hf_tensor_views  # noqa: E402
from miles.weightsync.actor_wire import WeightSync  # noqa: E402
from miles.weightsync.flat import FlatWeights  # noqa: E402
from miles.weightsync.one_rank import OneRankPlan, one_rank_export  # noqa: E402
from miles.weightsync.param_buffer import pack_parameters  # noqa: E402
from miles.weightsync.shard_plan import TransferPlan  # noqa: E402

torch.set_num_threads(1)


async def ab(directory: str, fw: FlatWeights, transport: str, bucket_mib: int, pushes: int,
             device: str = "cpu") -> dict[str, list[float]]:
    host = Host(TransportConfig(), directory)
    await host.start()
    cfg = SyncConfig(transport=transport, bucket_mib=bucket_mib, pause_mode="none", step_timeout_s=60)  # type: ignore[arg-type]
    sync = WeightSync(host, cfg, ["engine"], device)
    one = sync.one_rank
    if one is None:  # a transport not routed yet (NCCL broadcast): its one-rank coordinator, as the router builds it
        one = sync._solo(cfg, sync.coordinator.engines, cfg.pause_mode, cfg.verify_every)
        one.versions = sync.coordinator.versions
    export = one_rank_export(fw)
    assert export is not None

    async def gathered(version: int, fw: FlatWeights) -> Any:
        sync._use(sync.coordinator)  # as the router does: the coordinator reopens the channel it lost
        return await sync.coordinator.push(version, fw)

    async def one_rank(version: int, fw: FlatWeights) -> Any:
        sync._use(one)  # what `sync.push` does for a routed transport
        return await one.push(version, export)

    paths: dict[str, Any] = {"gathered": gathered, "one_rank": one_rank}
    times: dict[str, list[float]] = {k: [] for k in paths}
    phases: dict[str, list[tuple[float, float, int]]] = {k: [] for k in paths}
    version = int(time.time() * 1000) % 10**9
    try:
        for i in range(pushes):
            order = list(paths.items())
            for name, push in order if i % 2 == 0 else order[::-1]:  # alternate who goes first
                version += 1
                await push(version, fw)  # the switch: reopens the channel (and resends the plan)
                with torch.no_grad():
                    fw.buffer.add_(1)  # new bytes each version, in place, as an optimizer step
                if device != "cpu":
                    torch.cuda.synchronize(device)
                version += 1
                t0 = time.perf_counter()
                rep = await push(version, fw)
                times[name].append(time.perf_counter() - t0)
                phases[name].append((rep.transfer_s, rep.commit_s, rep.buckets))
                assert rep.committed == ["engine"] and rep.bytes == fw.plan.nbytes, rep
                if i == 0:  # which coordinator ran: only the sharded one counts the version's full bytes
                    assert (rep.full_bytes > 0) == (name == "one_rank"), (name, rep)
    finally:
        await sync.close()
        if one is not sync.one_rank:
            await one.close()
        await host.stop()
    for name, ph in phases.items():
        print(f"{transport} {name}: transfer {statistics.median(p[0] for p in ph) * 1e3:.1f} ms, commit "
              f"{statistics.median(p[1] for p in ph) * 1e3:.1f} ms (medians), {ph[0][2]} buckets")
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transports", default="zmq,ucx")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--bucket-mib", type=int, default=16)
    ap.add_argument("--pushes", type=int, default=15)
    ap.add_argument("--device", default="cpu", help="cuda: a bf16 model on the GPU, trainer and engine (GPU runs)")
    ap.add_argument("--cut", default="tensors", choices=["tensors", "bytes"],
                    help="one-rank buckets: the flat plan's ranges, cut at tensor boundaries (what runs), or "
                         "every bucket_mib across tensors, as a multi-rank plan cuts (before session 19)")
    a = ap.parse_args()
    if a.cut == "bytes":
        OneRankPlan.buckets = TransferPlan.buckets  # type: ignore[method-assign]
    transports = [t for t in a.transports.split(",") if t and (t != "ucx" or importlib.util.find_spec("ucxx"))]
    packed = make_model(a.hidden, a.layers, 2, a.device)
    pack_parameters(list(packed.parameters()))
    fw = FlatWeights.of(hf_tensor_views(packed).items())  # type: ignore[arg-type]
    mib = fw.plan.nbytes / 2**20
    rows, out = [], {}
    with tempfile.TemporaryDirectory(prefix="miles-bench-onerank-") as tmp:
        ready = str(Path(tmp) / "eready")
        eng, directory = spawn(["--serve-engine", str(a.hidden), str(a.layers), ready, a.device], ready)
        try:
            for tr in transports:
                times = asyncio.run(ab(directory, fw, tr, a.bucket_mib, a.pushes, a.device))
                med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                best = {k: min(v) * 1e3 for k, v in times.items()}
                rows.append((tr, med, best))
                out[tr] = {"gathered_median_ms": round(med["gathered"], 2), "one_rank_median_ms": round(med["one_rank"], 2),
                           "gathered_best_ms": round(best["gathered"], 2), "one_rank_best_ms": round(best["one_rank"], 2),
                           "one_rank_over_gathered": round(med["one_rank"] / med["gathered"], 3)}
        finally:
            eng.terminate()
            try:
                eng.wait(10)
            except subprocess.TimeoutExpired:  # an engine stuck in its channel's teardown: the numbers stand
                eng.kill()
                eng.wait(10)
    print(f"model {mib:.1f} MiB on {a.device}, {a.bucket_mib} MiB buckets (one-rank cut at {a.cut}), {a.pushes} "
          "pushes per path, interleaved")
    print(f"{'transport':>9} {'gathered ms (med/best)':>23} {'one-rank ms (med/best)':>23} {'ratio':>6}")
    for tr, med, best in rows:
        print(f"{tr:>9} {med['gathered']:11.1f}/{best['gathered']:<11.1f} {med['one_rank']:11.1f}/{best['one_rank']:<11.1f} "
              f"{med['one_rank'] / med['gathered']:6.3f}")
    print(json.dumps({"model_mib": round(mib, 1), "device": a.device, "bucket_mib": a.bucket_mib, "cut": a.cut,
                      "pushes": a.pushes,
                      **out}))


if __name__ == "__main__":
    main()
