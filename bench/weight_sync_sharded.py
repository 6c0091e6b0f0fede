"""Sharded weight sync vs today's gather-to-rank-0 (CPU, real processes, same run, same bytes).

4 FSDP trainer ranks (gloo) and 2 engine processes (real EngineActors over the same
architecture). Per transport, each round times one update both ways, back to back:

  gathered  every rank takes part in the gather into rank 0's flat export buffer
            (export_sync_state(flat=True)), then rank 0 alone pushes it (WeightSync: over zmq and ucx
            a sharded sync with one rank since session 17, weightsync/one_rank.py; over broadcast flat ranges)
  sharded   every rank casts its own slices into its send buffer (export_sharded_state) and
            sends them to every engine itself (ShardedWeightSync: transfer plan, no gather)

The two modes run one after the other per transport (an engine holds one bulk receiver).
Time = export + push, from a barrier of the 4 ranks to the commit on both engines, on rank 0.
GB/s = model bytes / time (each engine receives the whole model either way). Also reported:
the largest extra memory one rank holds for the sync (gathered: rank 0's flat buffer = the
model; sharded: a rank's send buffer = its shard). Median of the rounds after a warm-up.

Usage: python bench/weight_sync_sharded.py [--hidden 512 --layers 4 --rounds 5 --transports zmq,broadcast,ucx]
Prints a table, then one JSON line; --out writes the JSON to a file too.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from miles.actors.runtime.host import Host
from miles.core.schema.sync import SyncConfig
from miles.core.schema.transport import TransportConfig
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
WORLD = 4
ENGINES = ["e0", "e1"]


def spec(hidden: int, layers: int) -> ModelSpec:
    return ModelSpec.from_hf(tiny_config("qwen3", vocab_size=4096, hidden_size=hidden, intermediate_size=3 * hidden,
                                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                         head_dim=hidden // 8))


def serve_engine(name: str, hidden: int, layers: int, ready: str, directory: str) -> None:
    from miles.actors.engine import EngineActor
    from miles.actors.runtime.process import run
    from miles.core.schema.engine import EngineConfig
    from miles.engines.torch_engine import TorchEngine
    from miles.models.registry import build_model

    torch.set_num_threads(1)

    async def setup(host: Host) -> None:
        eng = TorchEngine(build_model(spec(hidden, layers), seed=1),
                          EngineConfig(max_batch_size=2, max_seq_len=64, device="cpu", dtype="float32"))
        await host.add(EngineActor(eng), name)

    sys.exit(run(setup, cfg=TransportConfig(heartbeat_timeout_s=30.0), directory=directory or None,
                 run_directory=not directory, ready_file=ready))


async def rank_main(rank: int, hidden: int, layers: int, directory: str, transports: list[str], rounds: int,
                    bucket_mib: int, ahead_mib: int, out: Path) -> None:
    import torch.distributed as dist

    from miles.actors.sync import ShardedWeightSync, WeightSync
    from miles.core.schema.trainer import TrainerConfig
    from miles.trainer.fsdp import FSDPTrainer

    torch.set_num_threads(1)
    cfg = TrainerConfig()
    cfg.device, cfg.world_size = "cpu", WORLD
    trainer = FSDPTrainer(cfg, spec(hidden, layers), rank, WORLD, seed=7)
    host = Host(TransportConfig(heartbeat_timeout_s=30.0), directory)
    await host.start()
    rows: list[dict[str, Any]] = []
    version = 0
    try:
        for transport in transports:
            scfg = SyncConfig(transport=transport, bucket_mib=bucket_mib, step_timeout_s=120,  # type: ignore[arg-type]
                              pause_mode="none", receive_ahead_mib=ahead_mib)
            times: dict[str, list[float]] = {"gathered": [], "sharded": []}
            nbytes = {"gathered": 0, "sharded": 0}
            # One mode after the other: an engine holds one bulk receiver, so the two coordinators
            # cannot keep channels open side by side (each would reopen it every version).
            for mode in ("gathered", "sharded"):
                sync: Any = (WeightSync(host, scfg, ENGINES) if rank == 0 else None) if mode == "gathered" else \
                    ShardedWeightSync(host, scfg, ENGINES)
                try:
                    for r in range(rounds + 1):  # round 0: warm-up (buffers, channels, plans)
                        version += 1
                        await asyncio.to_thread(dist.barrier)
                        t0 = time.perf_counter()
                        if mode == "gathered":
                            state = await asyncio.to_thread(trainer.export_sync_state, True)
                            if sync is not None:
                                nbytes[mode] = (await sync.push(version, state)).bytes
                        else:
                            nbytes[mode] = (await sync.push(version, trainer.export_sharded_state())).bytes
                        dt = time.perf_counter() - t0
                        if r > 0:
                            times[mode].append(dt)
                finally:
                    if sync is not None:
                        await sync.close()
                await asyncio.to_thread(dist.barrier)  # the engines let go of this mode's channel
            shard = trainer._shard_export.export.buffer.numel() if trainer._shard_export.export else 0
            flat = trainer._flat_export.weights.plan.nbytes if trainer._flat_export.weights else 0
            rows.append({"transport": transport, "times": times, "bytes": nbytes, "shard_bytes": shard,
                         "flat_buffer_bytes": flat})
    finally:
        await host.stop()
    if rank == 0:
        (out / "rank0.json").write_text(json.dumps(rows))


def spawn(args: list[str], log: Path, ready: str | None = None, env: dict[str, str] | None = None
          ) -> subprocess.Popen[bytes]:
    """A child running this script; its output goes to `log` (a pipe nobody drains would block it)."""
    with open(log, "wb") as f:
        p = subprocess.Popen([sys.executable, __file__, *args], stdout=f, stderr=subprocess.STDOUT,
                             env={**os.environ, **(env or {})})
    if ready is not None:
        deadline = time.monotonic() + 120
        while not os.path.exists(ready):
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"child {args} failed: {log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)
    return p


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bucket-mib", type=int, default=8)
    ap.add_argument("--receive-ahead-mib", type=int, default=SyncConfig().receive_ahead_mib,
                    help="sync.receive_ahead_mib (ucx engines); 0 = each bucket received when its header comes up")
    ap.add_argument("--transports", default="zmq,broadcast" + (",ucx" if importlib.util.find_spec("ucxx") else ""))
    ap.add_argument("--out", default="")
    ap.add_argument("--engine", nargs=4, metavar=("NAME", "READY", "DIRECTORY", "_"))
    ap.add_argument("--rank", nargs=4, metavar=("RANK", "PORT", "DIRECTORY", "OUTDIR"))
    a = ap.parse_args()
    transports = a.transports.split(",")
    if a.engine:
        serve_engine(a.engine[0], a.hidden, a.layers, a.engine[1], a.engine[2] if a.engine[2] != "-" else "")
        return
    if a.rank:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=a.rank[1])
        asyncio.run(rank_main(int(a.rank[0]), a.hidden, a.layers, a.rank[2], transports, a.rounds, a.bucket_mib,
                              a.receive_ahead_mib, Path(a.rank[3])))
        return

    from miles.core.ports import group_port

    model_bytes = sum(p.numel() for p in __import__("miles.models.registry", fromlist=["x"]).build_model(
        spec(a.hidden, a.layers), seed=0).parameters()) * 4
    shape = ["--hidden", str(a.hidden), "--layers", str(a.layers), "--rounds", str(a.rounds),
             "--transports", a.transports, "--bucket-mib", str(a.bucket_mib),
             "--receive-ahead-mib", str(a.receive_ahead_mib)]
    children: list[subprocess.Popen[bytes]] = []
    # UCX over TCP by default, as between hosts; MILES_BENCH_UCX_TLS picks others (tcp,sm,self: data
    # through shared memory between the processes of this host; "" leaves UCX its own choice).
    env = {"OMP_NUM_THREADS": "1"}
    tls = os.environ.get("MILES_BENCH_UCX_TLS", "tcp,self")
    if tls:
        env["UCX_TLS"] = tls
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        try:
            children.append(spawn([*shape, "--engine", "e0", str(root / "r0"), "-", "-"], root / "e0.log",
                                  str(root / "r0"), env))
            directory = (root / "r0").read_text()
            children.append(spawn([*shape, "--engine", "e1", str(root / "r1"), directory, "-"], root / "e1.log",
                                  str(root / "r1"), env))
            port = str(group_port())
            ranks = [spawn([*shape, "--rank", str(r), port, directory, str(root)], root / f"rank{r}.log", env=env)
                     for r in range(WORLD)]
            children += ranks
            for r, p in enumerate(ranks):
                if p.wait(1800) != 0:
                    raise RuntimeError(f"rank {r} failed: {(root / f'rank{r}.log').read_text(errors='replace')[-3000:]}")
            rows = json.loads((root / "rank0.json").read_text())
        finally:
            for p in children:
                if p.poll() is None:
                    p.terminate()
            for p in children:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()

    print(f"model {model_bytes / 2**20:.1f} MiB fp32, {WORLD} FSDP ranks (gloo) -> {len(ENGINES)} engines, "
          f"bucket {a.bucket_mib} MiB, median of {a.rounds} rounds (CPU, this machine's load included)")
    print(f"{'transport':<10} {'gathered s':>10} {'sharded s':>10} {'gath GB/s':>10} {'shard GB/s':>10} {'speed-up':>9}"
          f" {'rank-0 extra MiB':>17} {'per-rank extra MiB':>19}")
    result: dict[str, Any] = {"bench": "weight_sync_sharded", "model_bytes": model_bytes, "world": WORLD,
                              "engines": len(ENGINES), "bucket_mib": a.bucket_mib, "rounds": a.rounds, "rows": []}
    for row in rows:
        g, s = statistics.median(row["times"]["gathered"]), statistics.median(row["times"]["sharded"])
        out = {"transport": row["transport"], "gathered_s": g, "sharded_s": s,
               "gathered_gbps": model_bytes / g / 1e9, "sharded_gbps": model_bytes / s / 1e9, "speedup": g / s,
               "bytes_pushed": row["bytes"], "gathered_rank0_extra_bytes": row["flat_buffer_bytes"],
               "sharded_rank_extra_bytes": row["shard_bytes"], "times": row["times"]}
        result["rows"].append(out)
        print(f"{row['transport']:<10} {g:>10.3f} {s:>10.3f} {out['gathered_gbps']:>10.3f} {out['sharded_gbps']:>10.3f}"
              f" {g / s:>8.2f}x {row['flat_buffer_bytes'] / 2**20:>17.1f} {row['shard_bytes'] / 2**20:>19.1f}")
    line = json.dumps(result)
    if a.out:
        Path(a.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
