"""Deterministic mode on the full-size diffusion recipe: two runs, bit-identical weights?

Runs examples/diffusion.toml twice with `precision.deterministic = true` (which trains in
lock-step: generate a batch, train, push the weights) and compares every final weight
bit for bit, plus the per-step rewards; a third run with another seed must differ.

    python bench/diffusion_determinism.py [--checkpoint base.safetensors --classifier clf.safetensors] [--steps 40]

Results: bench/results/diffusion_cpu.determinism.json; last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from miles.core.config import load_config
from miles.diffusion.config import DiffusionConfig
from miles.diffusion.recipe import RecipeResult, run_recipe

REPO = Path(__file__).resolve().parent.parent


def one(a: argparse.Namespace, seed: int) -> tuple[RecipeResult, float]:
    sets = [f"run.dir={tempfile.mkdtemp(prefix='diffusion_det_')}", f"run.steps={a.steps}", "run.time_budget_s=0",
            f"run.seed={seed}", "run.log_level=warning", "precision.deterministic=true", "run.eval_every=10"]
    if a.checkpoint:
        sets.append(f"model.checkpoint={a.checkpoint}")
    if a.classifier:
        sets.append(f"reward.classifier={a.classifier}")
    t0 = time.perf_counter()
    res = run_recipe(load_config(DiffusionConfig, REPO / "examples" / "diffusion.toml", sets + a.set))
    return res, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="")
    ap.add_argument("--classifier", default="")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "diffusion_cpu.determinism.json"))
    a = ap.parse_args()
    (r1, s1), (r2, s2), (r3, s3) = one(a, 0), one(a, 0), one(a, 1)
    same = all(torch.equal(r1.final_state[k], r2.final_state[k]) for k in r1.final_state)
    differs = any(not torch.equal(r1.final_state[k], r3.final_state[k]) for k in r1.final_state)
    rew1 = [r["rollout/reward_mean"] for r in r1.rows]
    rew2 = [r["rollout/reward_mean"] for r in r2.rows]
    print(f"{'run':>4s} {'seed':>4s} {'seconds':>8s} {'eval first':>10s} {'eval last':>9s}")
    for i, (r, s, seed) in enumerate(((r1, s1, 0), (r2, s2, 0), (r3, s3, 1))):
        print(f"{i:4d} {seed:4d} {s:8.1f} {r.eval_rewards[0][1]:10.3f} {r.eval_rewards[-1][1]:9.3f}")
    summary = {"bench": "diffusion_determinism", "steps": a.steps, "checkpoint": a.checkpoint or "pretrained in each run",
               "weights_bit_identical": same, "rewards_identical": rew1 == rew2, "other_seed_differs": differs,
               "eval": [[s, v] for s, v in r1.eval_rewards], "seconds": [round(s1, 1), round(s2, 1), round(s3, 1)],
               "tensors": len(r1.final_state)}
    Path(a.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
