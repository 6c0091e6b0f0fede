"""fully_async vs sync: end-to-end trained tokens/s on a long-tailed workload, in one run.

Real (CPU here): full `miles train` runs (engine, rollout and trainer role processes over
ZeroMQ) of the quick-start model on the same long-tailed workload: every prompt gets a
log-normal `max_new_tokens` (rollout/envs/long_tail.py) and the untrained policy rarely
stops early, so response lengths follow that distribution. The engine process is pinned
to one core, the trainer and the rollout process to the other (taskset, one torch thread
each). Runs: sync, and fully_async under each `buffer.schedule` with the same staleness
bound: deadline (the default), budget, arrival with admission control, arrival with
discard-and-retry alone (the old default). Throughput = response tokens the trainer
trained on / wall time, over every step after the first (which fills the pipeline).

Scale model: bench/async_sim.py, a discrete-event SIMULATION with a latency model (not a
measurement), for fleets of 1-16 engines; same modes plus one_step_off.

Both parts also measure the bias toward short rollouts: mean response length of the
samples trained on vs of all samples generated (len ratio), and the share of generated
completions dropped as stale.

Sample efficiency (bench/async_efficiency.py): the quick-start task, sync vs fully_async,
reward against trained samples and wall time, several seeds; PNG + JSON under bench/results/.

Usage: python bench/async_vs_sync.py [--quick] [--parts real,sim,efficiency]    (last line: JSON)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import async_efficiency
from async_sim import Latency, Simulator

from miles.core.config import load_config
from miles.core.logging import configure_logging
from miles.core.schema import MilesConfig
from miles.launch.local import Child, LocalLauncher
from miles.metrics.sink import read_metrics
from miles.warmup.sft import with_initial_checkpoint

REPO = Path(__file__).resolve().parent.parent
CORES = sorted(os.sched_getaffinity(0))
# role -> cores: the engine alone on the first core, everything else on the last
PIN = {"engine": str(CORES[0]), "rollout": str(CORES[-1]), "trainer": str(CORES[-1])}

WORKLOAD = {"base": "miles.rollout.envs.arithmetic:make_env", "median_tokens": 12.0, "sigma": 1.0,
            "min_tokens": 2, "max_tokens": 160, "seed": 0, "ignore_stop": True}


N_SAMPLES = 4  # rollout.n_samples_per_prompt of the throughput runs
# (name, buffer.mode, buffer.schedule, buffer.admission_control)
REAL_RUNS = [("sync", "sync", "deadline", False), ("fully_async deadline", "fully_async", "deadline", False),
             ("fully_async budget", "fully_async", "budget", False),
             ("fully_async arrival+admission", "fully_async", "arrival", True),
             ("fully_async arrival (old default)", "fully_async", "arrival", False)]
EFFICIENCY_OUT = REPO / "bench" / "results" / "async_efficiency_cpu"


class PinnedLauncher(LocalLauncher):
    """The local launcher with every role process pinned to its cores, one torch thread each."""

    def _spawn(self, c: Child) -> None:
        if c.argv[0] != "taskset":
            c.argv = ["taskset", "-c", PIN[c.role], *c.argv]
            c.env = {**c.env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        super()._spawn(c)


def real_config(run_dir: Path, mode: str, schedule: str, admission: bool, steps: int) -> MilesConfig:
    sets = {
        "run.dir": str(run_dir), "run.steps": str(steps), "run.warmup_sft_steps": "0", "run.progress": "false",
        "run.log_level": "error", "rollout.env": "miles.rollout.envs.long_tail:make_env",
        "rollout.n_samples_per_prompt": str(N_SAMPLES), "rollout.max_new_tokens": str(WORKLOAD["max_tokens"]),
        "engine.max_seq_len": "192", "engine.max_batch_size": "64",
        "buffer.mode": mode, "buffer.batch_groups": "8", "buffer.max_staleness": "2",
        "buffer.capacity": "64" if mode == "fully_async" else "32",
        "buffer.admission_control": "true" if admission else "false", "buffer.schedule": schedule,
        "trainer.routing_replay": "false",
    }
    cfg = load_config(MilesConfig, REPO / "examples" / "quickstart.toml", [f"{k}={v}" for k, v in sets.items()])
    rollout = dataclasses.replace(cfg.rollout, env_args=dict(WORKLOAD))
    return dataclasses.replace(cfg, rollout=rollout)


def launch_and_read(cfg: Any, launcher: Any, name: str) -> tuple[list[dict[str, Any]], float]:
    """Warm-up checkpoint, a full launched run, its per-step metrics and wall time (logs on failure)."""
    cfg = with_initial_checkpoint(cfg)
    t0 = time.perf_counter()
    rc = asyncio.run(launcher(cfg).run())
    wall = time.perf_counter() - t0
    if rc != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                         for p in sorted((Path(cfg.run.dir) / "logs").glob("*")))
        raise SystemExit(f"{name}: miles run exited {rc}\n{logs}")
    return read_metrics(Path(cfg.run.dir) / "metrics.jsonl"), wall


def run_real(root: Path, name: str, mode: str, schedule: str, admission: bool, steps: int) -> dict[str, Any]:
    rows, wall = launch_and_read(real_config(root / name, mode, schedule, admission, steps), PinnedLauncher, name)
    timed = rows[1:]  # step 1 fills the pipeline (and pays process start-up)
    tokens = sum(r["rollout/trained_response_tokens"] for r in timed)
    seconds = sum(r["perf/step_time_s"] for r in timed)
    samples = sum(r["rollout/trained_response_tokens"] / max(r["rollout/response_len_mean"], 1e-9) for r in timed)
    last = rows[-1]
    return {"name": name, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "trained_len": tokens / max(samples, 1), "generated_len": last["rollout/generated_response_len_mean"],
            "stale_drops": sum(r["rollout/fully_async/stale_groups_filtered"] for r in rows),
            "stale_share": sum(r["rollout/fully_async/stale_groups_filtered"] for r in rows) * N_SAMPLES
            / max(1.0, last["rollout/generated_samples"]),
            "untrained_share": last["rollout/fully_async/untrained_share"],
            "window_len_ratio": last["rollout/fully_async/len_ratio"],
            "max_staleness": max(r["rollout/fully_async/max_staleness"] for r in rows), "wall": wall}


def real_part(steps: int, keep: str = "") -> dict[str, dict[str, Any]]:
    print(f"== real: quick-start model on CPU, engine on core {PIN['engine']}, trainer+rollout on core "
          f"{PIN['trainer']}; log-normal max_new_tokens (median {WORKLOAD['median_tokens']}, sigma "
          f"{WORKLOAD['sigma']}, <= {WORKLOAD['max_tokens']}); 8 groups x 4 samples a step; {steps} steps")
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="miles-async-bench-") as tmp_dir:
        tmp = keep or tmp_dir
        for i, (name, mode, schedule, adm) in enumerate(REAL_RUNS):
            out[name] = run_real(Path(tmp), f"run{i}", mode, schedule, adm, steps)
            out[name]["name"] = name
    base = out["sync"]["tok_s"]
    print(f"{'run':34s} {'trained tok/s':>13s} {'vs sync':>8s} {'trained len':>11s} {'generated len':>13s} "
          f"{'len ratio':>9s} {'stale drops':>11s} {'stale share':>11s} {'max stale':>9s}")
    for r in out.values():
        print(f"{r['name']:34s} {r['tok_s']:13.1f} {r['tok_s'] / base:7.2f}x {r['trained_len']:11.1f} "
              f"{r['generated_len']:13.1f} {r['trained_len'] / r['generated_len']:9.2f} {r['stale_drops']:11.0f} "
              f"{r['stale_share']:11.1%} {r['max_staleness']:9.0f}")
    return out


def efficiency_part(steps: int, seeds: int, keep: str = "", out: Path = EFFICIENCY_OUT,
                    extra: list[str] | None = None, with_old: bool = True) -> dict[str, Any]:
    print(f"\n== sample efficiency: quick start (examples/quickstart.toml, {steps} steps), sync vs "
          f"fully_async (schedule deadline), seeds 0..{seeds - 1}; engine on core {PIN['engine']}, trainer+rollout "
          f"on core {PIN['trainer']}")
    # the old default once (seed 0): what the quick start wasted before (the issue: 57% stale)
    plan = [(m, sched, seed) for seed in range(seeds) for m, sched in (("sync", "deadline"), ("fully_async", "deadline"))]
    if with_old:
        plan.append(("fully_async arrival (old default)", "arrival", 0))
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m, _, _ in plan}
    with tempfile.TemporaryDirectory(prefix="miles-async-eff-") as tmp_dir:
        tmp = Path(keep or tmp_dir)
        for name, schedule, seed in plan:
            mode = "sync" if name == "sync" else "fully_async"
            cfg = async_efficiency.quickstart_config(tmp / f"{name.split()[0]}-{schedule}-s{seed}", mode, seed, steps,
                                                     schedule, extra)
            rows, _ = launch_and_read(cfg, PinnedLauncher, f"{name} seed {seed}")
            runs[name].append(async_efficiency.run_summary(rows, cfg))
            r = runs[name][-1]
            print(f"  {name:34s} seed {seed}: final reward {statistics.fmean(r['reward'][-steps // 4:]):.3f}, "
                  f"wall {r['wall_s'][-1]:.0f} s, stale share {r['stale_share']:.1%}, len ratio "
                  f"{r['len_ratio']:.2f}", flush=True)
    summary = async_efficiency.compare(runs)
    b = cfg.buffer
    title = (f"quick start on CPU (2 cores, shared): sync vs fully_async (deadline, max_staleness {b.max_staleness}), "
             f"{steps} steps x {b.batch_groups * cfg.rollout.n_samples_per_prompt} samples, {seeds} seeds")
    async_efficiency.save(runs, summary, out, title)
    print(f"{'mode':34s} {'final reward per seed':>30s} {'steps to ' + str(summary['target_reward']):>18s} "
          f"{'wall s total':>16s} {'stale share':>20s}")
    for m in runs:
        sm = summary[m]
        print(f"{m:34s} {str(sm['final_reward']):>30s} {str(sm['steps_to_target']):>18s} "
              f"{str([round(w) for w in sm['wall_s_total']]):>16s} {str(sm['stale_share']):>20s}")
    print(f"saved {out.with_suffix('.png')} and .json")
    return summary


SIM_RUNS = [("sync", "sync", {}), ("one_step_off", "one_step_off", {}),
            ("fully_async deadline", "fully_async", {"deadline": True}),
            ("fully_async budget", "fully_async", {"budget": True}),
            ("fully_async arrival+admission", "fully_async", {"admission": True}),
            ("fully_async arrival (old default)", "fully_async", {})]


def sim_part(fleets: list[int], steps: int) -> dict[int, dict[str, Any]]:
    lat = Latency(slots_per_engine=128)
    print(f"\n== SIMULATION (latency model, not measured): decode step {lat.step_base_ms} ms + "
          f"{lat.step_per_seq_ms} ms/seq, {lat.slots_per_engine} slots/engine; lengths log-normal "
          f"(median {lat.median_len:.0f}, sigma {lat.sigma_prompt}/prompt + {lat.sigma_sample}/sample, <= "
          f"{lat.max_len}); train {lat.train_fixed_s} s + tokens / ({lat.train_tok_s_per_engine:.0f} tok/s x "
          f"engines); update pause {lat.update_s} s; batch 2 groups x 8 / engine; max_staleness 2; {steps} steps")
    print(f"{'engines':>7s} {'mode':34s} {'trained tok/s':>13s} {'vs sync':>8s} {'trained len':>11s} "
          f"{'generated len':>13s} {'len ratio':>9s} {'stale drops':>11s} {'discarded':>9s} {'max stale':>9s}")
    out: dict[int, dict[str, Any]] = {}
    for e in fleets:
        rs = {name: Simulator(lat, e, m, groups_per_engine=2, steps=steps, **kw).run() for name, m, kw in SIM_RUNS}
        base = rs["sync"].tokens_per_s
        for name, r in rs.items():
            print(f"{e:7d} {name:34s} {r.tokens_per_s:13.0f} {r.tokens_per_s / base:7.2f}x "
                  f"{r.trained_len_mean:11.0f} {r.generated_len_mean:13.0f} "
                  f"{r.trained_len_mean / r.generated_len_mean:9.2f} {r.drops:11d} {r.discarded:9d} "
                  f"{r.max_staleness:9d}")
        out[e] = {name: {"speedup": round(r.tokens_per_s / base, 3),
                         "len_ratio": round(r.trained_len_mean / r.generated_len_mean, 3), "stale_drops": r.drops,
                         "max_staleness": r.max_staleness} for name, r in rs.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer steps, fleet sizes and seeds")
    ap.add_argument("--keep", default="", help="write the real runs' directories here (kept)")
    ap.add_argument("--parts", default="real,sim,efficiency", help="comma-separated: real, sim, efficiency")
    ap.add_argument("--steps", type=int, default=30, help="steps of each throughput run")
    ap.add_argument("--efficiency-steps", type=int, default=200, help="steps of each quick-start run (its own: 200)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per mode in the efficiency part")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="KEY=VALUE for every efficiency run (e.g. buffer.max_staleness=1)")
    ap.add_argument("--out", default="", help="efficiency results (.json/.png) here instead of the default")
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    if parts - {"real", "sim", "efficiency"}:
        raise SystemExit(f"--parts: unknown {sorted(parts - {'real', 'sim', 'efficiency'})}")
    configure_logging("error", None, run="bench", role="launcher")
    result: dict[str, Any] = {}
    if "real" in parts:
        real = real_part(5 if a.quick else a.steps, a.keep and str(Path(a.keep) / "real"))
        base = real["sync"]["tok_s"]
        result |= {
            "real_speedup": {k: round(v["tok_s"] / base, 3) for k, v in real.items()},
            "real_tok_s": {k: round(v["tok_s"], 1) for k, v in real.items()},
            "real_len_ratio": {k: round(v["trained_len"] / v["generated_len"], 3) for k, v in real.items()},
            "real_stale_share": {k: round(v["stale_share"], 4) for k, v in real.items()},
            "real_untrained_share": {k: round(v["untrained_share"], 4) for k, v in real.items()},
        }
    if "sim" in parts:
        sim = sim_part([1, 4] if a.quick else [1, 2, 4, 8, 16], 10 if a.quick else 30)
        for name in ("fully_async deadline", "fully_async budget", "fully_async arrival+admission",
                     "fully_async arrival (old default)"):
            sp = {e: v[name]["speedup"] for e, v in sim.items()}
            lr = {e: v[name]["len_ratio"] for e, v in sim.items()}
            print(f"sim {name}: vs sync by engines {sp}; len ratio {lr}")
        result["sim"] = sim
    if "efficiency" in parts:
        out = Path(a.out) if a.out else EFFICIENCY_OUT.with_name(EFFICIENCY_OUT.name + "_quick") if a.quick else (
            EFFICIENCY_OUT)
        result["efficiency"] = efficiency_part(
            5 if a.quick else a.efficiency_steps, 1 if a.quick else a.seeds, a.keep and str(Path(a.keep) / "efficiency"),
            out, a.sets, with_old=not a.sets)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
