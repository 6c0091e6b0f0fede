"""SIMULATION (an analytic model, not a measurement): one weight update and one RL step for a fleet.

Transports modelled:
  bcast_ring / bcast_tree  today's gathered path at scale: the trainer gathers each bucket to one
                           source GPU, which NCCL-broadcasts it to every rollout GPU (each engine
                           rank receives the whole bucket and keeps its slice)
  p2p                      the sharded plan (weightsync/shard_plan.py): every trainer GPU sends
                           its own bytes straight to the engine GPUs that hold them
  delta                    p2p sending only the changed fraction of the bytes (sparse, with indices)

Per transport, time = bandwidth term + per-bucket fixed cost + latency term + fixed post-transfer
work (e.g. an FP8 requantization). The two constants that are not hardware facts come from
miles' own measurements (bench/results), never from the paper's table:
  link_eff      achieved / nominal link bandwidth: NCCL broadcast 2xH200 over NVLink reached
                ~370 GB/s of a nominal 450 GB/s (multigpu_h200x2_weight_sync_s3.json, raw flat)
  bucket_cost_s fixed cost per bucket: miles' bucketed broadcast vs the raw one, same bytes
                (the same file: (update_s - bytes/raw) / buckets, median over its rows)
A CPU check of the model's structure runs against bench/results/weight_sync_sharded_cpu.json
(4 ranks, 2 engines): on 2 shared cores every byte a process moves costs the same CPU, so the
speed-up predicted is the ratio of bytes moved (gathered: gather + push; sharded: push only).

Usage: python bench/sync_sim.py [--plot docs/img/sync_sim.png]. Prints tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).with_name("results")


@dataclass(frozen=True)
class Fleet:
    name: str
    params: float  # total parameters
    wire_bytes_per_param: float  # 2: bf16 on the wire; ~1.03: FP8 codes + block scales
    nodes: int  # per side (trainer nodes = rollout nodes)
    gpus_per_node: int = 8
    engine_gpus: int = 8  # GPUs of one rollout engine (its TP x EP), each holding 1/engine_gpus of the model
    nic_gbit: float = 400.0  # per GPU (H100/H200 clusters: one 400 Gb/s NIC per GPU)
    nvlink_gbyte: float = 450.0  # per GPU, one direction
    bucket_bytes: float = 1e9
    post_s: float = 0.0  # fixed work after the transfer (e.g. requantization on the engine)
    delta_density: float = 0.02  # fraction of elements that change per step (delta transport)

    @property
    def model_bytes(self) -> float:
        return self.params * self.wire_bytes_per_param


@dataclass(frozen=True)
class Calib:
    link_eff: float
    bucket_cost_s: float
    hop_latency_s: float = 20e-6  # per NCCL hop (ring step / tree level), a hardware-order figure
    chunk_bytes: float = 4 << 20  # NCCL pipelining chunk


def calibrate() -> tuple[Calib, dict[str, Any]]:
    """Link efficiency and per-bucket cost from miles' 2xH200 NCCL run (bench/results)."""
    f = RESULTS / "multigpu_h200x2_weight_sync_s3.json"
    d = json.loads(f.read_text())
    rows = d["rows"]
    raw = statistics.median(r["raw_flat_gb_s"] for r in rows)
    eff = raw / 450.0  # NV18 on an H200: 18 links x 25 GB/s per direction
    costs = [(r["update_s"] - r["bytes"] / (r["raw_flat_gb_s"] * 1e9)) / r["n_buckets"] for r in rows]
    cost = statistics.median(costs)
    return Calib(link_eff=eff, bucket_cost_s=cost), {"source": str(f.relative_to(RESULTS.parent)),
                                                      "raw_gbps": raw, "link_eff": eff, "bucket_cost_s": cost}


def update_time(f: Fleet, c: Calib, transport: str) -> dict[str, float]:
    """Seconds of one weight update (end of pause -> update call returns), by term."""
    nic = f.nic_gbit / 8 * 1e9 * c.link_eff
    nvl = f.nvlink_gbyte * 1e9 * c.link_eff
    M = f.model_bytes
    trainer_gpus = rollout_gpus = f.nodes * f.gpus_per_node
    replicas = max(1, rollout_gpus // f.engine_gpus)
    if transport.startswith("bcast"):
        n_b = math.ceil(M / f.bucket_bytes)
        # gather: each bucket's shards come to the source GPU, 1/nodes of them over NVLink, the rest
        # over its NIC; the broadcast then pushes every byte through the source's NIC once.
        gather = M / f.nodes / nvl + M * (1 - 1 / f.nodes) / nic
        bw = M / nic
        hops = rollout_gpus if transport == "bcast_ring" else math.ceil(math.log2(rollout_gpus + 1))
        lat = n_b * hops * (c.hop_latency_s + c.chunk_bytes / nic)
        out = {"bandwidth_s": gather + bw, "buckets_s": n_b * c.bucket_cost_s, "latency_s": lat}
    else:
        frac = 1.0 if transport == "p2p" else min(1.0, f.delta_density * (1 + 4 / f.wire_bytes_per_param))
        # every trainer GPU sends its shard to each replica (sender side), every engine GPU receives
        # its 1/engine_gpus slice (receiver side); the slower side sets the time.
        send = M * frac / trainer_gpus * replicas / nic
        recv = M * frac / f.engine_gpus / nic
        n_b = math.ceil(M * frac / trainer_gpus / f.bucket_bytes) * replicas
        out = {"bandwidth_s": max(send, recv), "buckets_s": n_b * c.bucket_cost_s, "latency_s": c.hop_latency_s}
    out["post_s"] = f.post_s
    out["total_s"] = sum(out.values())
    return out


def rl_step(f: Fleet, c: Calib, transport: str, compute_s: float) -> dict[str, float]:
    """One RL step: `compute_s` of rollout + training that the update does not overlap, plus the update."""
    u = update_time(f, c, transport)["total_s"]
    return {"update_s": u, "step_s": compute_s + u, "update_share": u / (compute_s + u)}


# Table 8 of the seed (Miles v0.1): the two rows the issue quotes. The seed text stored here has the
# table's caption but not its rows' fleet sizes, so the node count is swept (2..16 per side) and
# the published value is compared at every size; nothing below is fitted to them.
TABLE8 = [
    {"model": "Kimi-K2", "bcast_s": 53.3, "p2p_s": 7.23,
     "fleet": Fleet("Kimi-K2", 1.04e12, 2.0, 2, engine_gpus=16, post_s=0.884)},
    {"model": "GLM-5", "bcast_s": 58.3, "p2p_s": 8.48,
     "fleet": Fleet("GLM-5", 7.44e11, 2.0, 2, engine_gpus=16)},
]


def cpu_check() -> dict[str, Any] | None:
    """Structure check on what miles measures here: gathered vs sharded, 4 ranks -> 2 engines, CPU."""
    f = RESULTS / "weight_sync_sharded_cpu.json"
    if not f.exists():
        return None
    d = json.loads(f.read_text())
    world, engines = d["world"], d["engines"]
    # bytes every process moves, in model units: gathered = all-gather (each rank receives
    # (world-1)/world) + rank 0 pushing to each engine; sharded = the push alone
    gathered = world * (world - 1) / world + engines
    sharded = engines
    return {"predicted_speedup": gathered / sharded,
            "measured": {r["transport"]: round(r["speedup"], 2) for r in d["rows"]}, "source": str(f)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plot", default="")
    ap.add_argument("--glm-compute-s", type=float, default=0.0,
                    help="step time outside the update for the GLM-5.2 projection; 0 = 263 s minus the "
                         "simulated broadcast update (the seed's median step, assumed to include one)")
    a = ap.parse_args()
    c, calib = calibrate()
    print("SIMULATION, not a measurement. Calibration (miles' own results):", json.dumps(calib))
    print()
    print(f"{'model':<8} {'nodes/side':>10} {'bcast_ring s':>12} {'bcast_tree s':>12} {'p2p s':>8} {'delta s':>8}"
          f" {'pub bcast':>9} {'pub p2p':>8} {'ring err':>9} {'p2p err':>8}")
    table8: list[dict[str, Any]] = []
    sweep: dict[str, list[dict[str, float]]] = {}
    for row in TABLE8:
        for nodes in (2, 4, 8, 16):
            f = replace(row["fleet"], nodes=nodes)
            t = {tr: update_time(f, c, tr)["total_s"] for tr in ("bcast_ring", "bcast_tree", "p2p", "delta")}
            rec = {"model": row["model"], "nodes": nodes, **t, "published_bcast_s": row["bcast_s"],
                   "published_p2p_s": row["p2p_s"], "ring_err": t["bcast_ring"] / row["bcast_s"] - 1,
                   "p2p_err": t["p2p"] / row["p2p_s"] - 1}
            table8.append(rec)
            sweep.setdefault(row["model"], []).append(rec)
            print(f"{row['model']:<8} {nodes:>10} {t['bcast_ring']:>12.2f} {t['bcast_tree']:>12.2f} {t['p2p']:>8.2f}"
                  f" {t['delta']:>8.2f} {row['bcast_s']:>9.1f} {row['p2p_s']:>8.2f} {rec['ring_err']:>+9.0%}"
                  f" {rec['p2p_err']:>+8.0%}")
    # GLM-5.2 reference step: the seed's Table 9 rows are not in the stored text either; assumed a
    # GLM-5-sized model (744B, bf16 on the wire) on 8 nodes per side, 16-GPU engines.
    glm = replace(TABLE8[1]["fleet"], name="GLM-5.2 (assumed GLM-5 size)", nodes=8)
    bc = update_time(glm, c, "bcast_ring")["total_s"]
    compute = a.glm_compute_s or 263.0 - bc
    proj = {tr: rl_step(glm, c, tr, compute) for tr in ("bcast_ring", "bcast_tree", "p2p", "delta")}
    print()
    print(f"GLM-5.2 step projection (median 263 s published; compute outside the update {compute:.1f} s, assumed):")
    for tr, p in proj.items():
        print(f"  {tr:<11} update {p['update_s']:7.2f} s   step {p['step_s']:7.1f} s   update share {p['update_share']:.1%}")
    cpu = cpu_check()
    if cpu:
        print()
        print(f"CPU structure check: predicted sharded/gathered speed-up {cpu['predicted_speedup']:.2f}x, "
              f"measured {cpu['measured']}")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, (model, recs) in zip(axes, sweep.items(), strict=True):
            xs = [r["nodes"] for r in recs]
            for tr, style in (("bcast_ring", "-o"), ("bcast_tree", "--o"), ("p2p", "-s"), ("delta", ":^")):
                ax.plot(xs, [r[tr] for r in recs], style, label=f"sim {tr}")
            ax.axhline(recs[0]["published_bcast_s"], color="gray", lw=0.8, label="published broadcast")
            ax.axhline(recs[0]["published_p2p_s"], color="black", lw=0.8, ls="--", label="published P2P")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("nodes per side")
            ax.set_ylabel("seconds per weight update")
            ax.set_title(f"{model} (SIMULATION)")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(a.plot, dpi=120)
        print(f"plot: {a.plot}")
    out = {"bench": "sync_sim", "simulation": True, "calibration": calib, "table8": table8,
           "glm52_projection": {"fleet": asdict(glm), "compute_s": compute, **proj}, "cpu_check": cpu}
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
