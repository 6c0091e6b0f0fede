"""The diffusion recipe's CPU training curve: examples/diffusion.toml end to end.

Pretrains the flow policy from scratch, trains the circle classifier, then runs GRPO fully
asynchronously (engine actor + weight sync + the shared buffer/ledger) for the config's time
budget. Reports the evaluation reward (64 fixed seeds) against RL wall time, the time to
first reach 0.8, the ledger, staleness and sync time.

    python bench/diffusion_cpu.py [--set key=value ...]

Results: bench/results/diffusion_cpu.json (per-step rows), diffusion_cpu.png (curve),
diffusion_cpu.samples_first.png / .samples_last.png; last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from miles.core.config import load_config
from miles.diffusion.config import DiffusionConfig
from miles.diffusion.plots import write_diffusion_plots
from miles.diffusion.recipe import run_recipe

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "examples" / "diffusion.toml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=str(OUT / "diffusion_cpu"), help="result path prefix")
    a = ap.parse_args()
    run_dir = tempfile.mkdtemp(prefix="diffusion_cpu_")
    cfg = load_config(DiffusionConfig, a.config, [f"run.dir={run_dir}", "run.log_level=warning", *a.set])
    res = run_recipe(cfg)
    write_diffusion_plots(run_dir, res.rows, res.eval_rewards, res.first_images, res.last_images,
                          f"{cfg.run.name}: eval reward vs step")
    prefix = Path(a.out)
    for src, suffix in (("reward_curve.png", ".png"), ("samples_first.png", ".samples_first.png"),
                        ("samples_last.png", ".samples_last.png")):
        if (Path(run_dir) / src).exists():
            shutil.copyfile(Path(run_dir) / src, str(prefix) + suffix)
    elapsed = {r["step"]: r["perf/elapsed_s"] for r in res.rows}
    evals = [(s, round(elapsed.get(s, 0.0), 1), round(v, 4)) for s, v in res.eval_rewards]
    reach = next(((s, t) for s, t, v in evals if v >= 0.8), None)
    print(f"{'step':>5s} {'RL time [s]':>11s} {'eval reward':>11s}")
    for s, t, v in evals:
        print(f"{s:5d} {t:11.1f} {v:11.3f}")
    keep = ("step", "rollout/reward_mean", "eval/reward_mean", "perf/elapsed_s", "perf/step_time_s", "perf/sync_s",
            "train/kl", "train/logp_abs_diff", "train/staleness", "train/clip_fraction",
            "rollout/fully_async/avg_staleness", "rollout/fully_async/stale_groups_filtered", "ledger/trained")
    summary = {
        "bench": "diffusion_cpu", "config": os.path.relpath(a.config, REPO), "overrides": a.set,
        "threads_per_worker": cfg.run.threads, "cpus": os.cpu_count(),
        "pretrain_s": round(res.pretrain_seconds, 1), "rl_s": round(res.seconds, 1), "steps": len(res.rows),
        "eval_reward_first": evals[0][2], "eval_reward_last": evals[-1][2],
        "eval_reward_max": max(v for _, _, v in evals),
        "first_step_eval_ge_0.8": reach[0] if reach else None, "rl_s_to_eval_ge_0.8": reach[1] if reach else None,
        "ledger": res.ledger, "mode": cfg.buffer.mode,
    }
    Path(str(prefix) + ".json").write_text(json.dumps(
        {**summary, "evals": evals, "rows": [{k: r.get(k) for k in keep} for r in res.rows]}, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
