"""fully_async vs sync: end-to-end trained tokens/s on a long-tailed workload, in one run.

Real (CPU here): full `miles train` runs (engine, rollout and trainer role processes over
ZeroMQ) of the quick-start model on the same long-tailed workload: every prompt gets a
log-normal `max_new_tokens` (rollout/envs/long_tail.py) and the untrained policy rarely
stops early, so response lengths follow that distribution. The engine process is pinned
to one core, the trainer and the rollout process to the other (taskset, one torch thread
each). Runs: sync, fully_async with admission control, fully_async with
discard-and-retry alone (same staleness bound). Throughput = response tokens the trainer
trained on / wall time, over every step after the first (which fills the pipeline).

Scale model: bench/async_sim.py, a discrete-event SIMULATION with a latency model (not a
measurement), for fleets of 1-16 engines; same modes plus one_step_off.

Both parts also measure the bias toward short rollouts: mean response length of the
samples trained on vs of all samples generated.

Usage: python bench/async_vs_sync.py [--quick]    (last line: JSON)
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

from async_sim import Latency, Simulator

from miles.core.config import load_config
from miles.core.logging import configure_logging
from miles.core.schema import MilesConfig
from miles.launch.local import Child, LocalLauncher
from miles.launch.metrics import read_metrics
from miles.launch.warmup import with_initial_checkpoint

REPO = Path(__file__).resolve().parent.parent
CORES = sorted(os.sched_getaffinity(0))
# role -> cores: the engine alone on the first core, everything else on the last
PIN = {"engine": str(CORES[0]), "rollout": str(CORES[-1]), "trainer": str(CORES[-1])}

WORKLOAD = {"base": "miles.rollout.envs.arithmetic:make_env", "median_tokens": 12.0, "sigma": 1.0,
            "min_tokens": 2, "max_tokens": 160, "seed": 0, "ignore_stop": True}


class PinnedLauncher(LocalLauncher):
    """The local launcher with every role process pinned to its cores, one torch thread each."""

    def _spawn(self, c: Child) -> None:
        if c.argv[0] != "taskset":
            c.argv = ["taskset", "-c", PIN[c.role], *c.argv]
            c.env = {**c.env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        super()._spawn(c)


def real_config(run_dir: Path, mode: str, admission: bool, steps: int) -> MilesConfig:
    sets = {
        "run.dir": str(run_dir), "run.steps": str(steps), "run.warmup_sft_steps": "0", "run.progress": "false",
        "run.log_level": "error", "rollout.env": "miles.rollout.envs.long_tail:make_env",
        "rollout.n_samples_per_prompt": "4", "rollout.max_new_tokens": str(WORKLOAD["max_tokens"]),
        "engine.max_seq_len": "192", "engine.max_batch_size": "64",
        "buffer.mode": mode, "buffer.batch_groups": "8", "buffer.max_staleness": "2",
        "buffer.capacity": "64" if mode == "fully_async" else "32",
        "buffer.admission_control": "true" if admission else "false",
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


def run_real(root: Path, name: str, mode: str, admission: bool, steps: int) -> dict[str, Any]:
    rows, wall = launch_and_read(real_config(root / name, mode, admission, steps), PinnedLauncher, name)
    timed = rows[1:]  # step 1 fills the pipeline (and pays process start-up)
    tokens = sum(r["rollout/trained_response_tokens"] for r in timed)
    seconds = sum(r["perf/step_time_s"] for r in timed)
    samples = sum(r["rollout/trained_response_tokens"] / max(r["rollout/response_len_mean"], 1e-9) for r in timed)
    last = rows[-1]
    return {"name": name, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "trained_len": tokens / max(samples, 1), "generated_len": last["rollout/generated_response_len_mean"],
            "stale_drops": sum(r["rollout/fully_async/stale_groups_filtered"] for r in rows),
            "max_staleness": max(r["rollout/fully_async/max_staleness"] for r in rows), "wall": wall}


def real_part(steps: int, keep: str = "") -> dict[str, dict[str, Any]]:
    print(f"== real: quick-start model on CPU, engine on core {PIN['engine']}, trainer+rollout on core "
          f"{PIN['trainer']}; log-normal max_new_tokens (median {WORKLOAD['median_tokens']}, sigma "
          f"{WORKLOAD['sigma']}, <= {WORKLOAD['max_tokens']}); 8 groups x 4 samples a step; {steps} steps")
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="miles-async-bench-") as tmp_dir:
        tmp = keep or tmp_dir
        for i, (name, mode, adm) in enumerate([("sync", "sync", False), ("fully_async+admission", "fully_async", True),
                                               ("fully_async (discard-and-retry)", "fully_async", False)]):
            out[name] = run_real(Path(tmp), f"run{i}", mode, adm, steps)
            out[name]["name"] = name
    base = out["sync"]["tok_s"]
    print(f"{'run':34s} {'trained tok/s':>13s} {'vs sync':>8s} {'trained len':>11s} {'generated len':>13s} "
          f"{'stale drops':>11s} {'max stale':>9s}")
    for r in out.values():
        print(f"{r['name']:34s} {r['tok_s']:13.1f} {r['tok_s'] / base:7.2f}x {r['trained_len']:11.1f} "
              f"{r['generated_len']:13.1f} {r['stale_drops']:11.0f} {r['max_staleness']:9.0f}")
    return out


def sim_part(fleets: list[int], steps: int) -> dict[int, dict[str, Any]]:
    lat = Latency(slots_per_engine=128)
    print(f"\n== SIMULATION (latency model, not measured): decode step {lat.step_base_ms} ms + "
          f"{lat.step_per_seq_ms} ms/seq, {lat.slots_per_engine} slots/engine; lengths log-normal "
          f"(median {lat.median_len:.0f}, sigma {lat.sigma_prompt}/prompt + {lat.sigma_sample}/sample, <= "
          f"{lat.max_len}); train {lat.train_fixed_s} s + tokens / ({lat.train_tok_s_per_engine:.0f} tok/s x "
          f"engines); update pause {lat.update_s} s; batch 2 groups x 8 / engine; max_staleness 2; {steps} steps")
    print(f"{'engines':>7s} {'mode':28s} {'trained tok/s':>13s} {'vs sync':>8s} {'trained len':>11s} "
          f"{'generated len':>13s} {'stale drops':>11s} {'discarded':>9s}")
    out: dict[int, dict[str, Any]] = {}
    for e in fleets:
        rs = [Simulator(lat, e, m, groups_per_engine=2, steps=steps, admission=a).run()
              for m, a in [("sync", False), ("one_step_off", False), ("fully_async", True), ("fully_async", False)]]
        base = rs[0].tokens_per_s
        for r in rs:
            label = r.mode if r.mode != "fully_async" else "fully_async (discard-and-retry)"
            print(f"{e:7d} {label:28s} {r.tokens_per_s:13.0f} {r.tokens_per_s / base:7.2f}x "
                  f"{r.trained_len_mean:11.0f} {r.generated_len_mean:13.0f} {r.drops:11d} {r.discarded:9d}")
        out[e] = {"speedup": rs[2].tokens_per_s / base, "discard_speedup": rs[3].tokens_per_s / base,
                  "one_step_off_speedup": rs[1].tokens_per_s / base,
                  "admission_len_ratio": rs[2].trained_len_mean / rs[2].generated_len_mean,
                  "discard_len_ratio": rs[3].trained_len_mean / rs[3].generated_len_mean}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer steps and fleet sizes")
    ap.add_argument("--keep", default="", help="write the real runs' directories here (kept)")
    ap.add_argument("--real-only", action="store_true", help="skip the simulation")
    a = ap.parse_args()
    configure_logging("error", None, run="bench", role="launcher")
    real = real_part(5 if a.quick else 20, a.keep)
    if a.real_only:
        return
    sim = sim_part([1, 4] if a.quick else [1, 2, 4, 8, 16], 10 if a.quick else 30)
    base = real["sync"]["tok_s"]
    adm, disc = real["fully_async+admission"], real["fully_async (discard-and-retry)"]
    print(f"\nreal: fully_async+admission {adm['tok_s'] / base:.2f}x sync; discard-and-retry "
          f"{disc['tok_s'] / base:.2f}x; trained/generated length {adm['trained_len'] / adm['generated_len']:.2f} "
          f"(admission) vs {disc['trained_len'] / disc['generated_len']:.2f} (discard-and-retry)")
    sp = {e: round(v["speedup"], 2) for e, v in sim.items()}
    print(f"sim: fully_async+admission vs sync by engines {sp} (goal >= 2.5x; AReaL 2.77x, verl 2.35x)")
    print(json.dumps({
        "real_speedup": round(adm["tok_s"] / base, 3),
        "real_discard_speedup": round(disc["tok_s"] / base, 3),
        "real_tok_s": {k: round(v["tok_s"], 1) for k, v in real.items()},
        "real_len_ratio": {k: round(v["trained_len"] / v["generated_len"], 3) for k, v in real.items()},
        "sim_speedup": round(statistics.median(sp.values()), 3),
        "sim_speedup_by_engines": sp,
        "sim_discard_speedup_by_engines": {e: round(v["discard_speedup"], 2) for e, v in sim.items()},
        "sim_len_ratio_admission": {e: round(v["admission_len_ratio"], 3) for e, v in sim.items()},
        "sim_len_ratio_discard": {e: round(v["discard_len_ratio"], 3) for e, v in sim.items()},
    }))


if __name__ == "__main__":
    main()
