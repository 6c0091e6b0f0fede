"""Train/rollout log-probability mismatch of the diffusion policy, per denoising step, by precision.

The rollout engine (diffusion/engine.py) samples SDE trajectories with its weights in the
given precision and records each transition's log-probability; the trainer (FSDP2 on one
CPU rank, FP32 compute, the same weights) recomputes them. Reported per mode: the mean and
max |logp_trainer - logp_engine| over all transitions, and the mean per denoising step.
Modes: the engine in FP32; all-BF16; BF16 with per-parameter FP32 pattern sets. Also the
trainer in BF16 with the engine's own patterns (both sides in the same mixed precision).

    python bench/diffusion_precision.py [--checkpoint base.safetensors] [--images 64]

Results: bench/results/diffusion_cpu.precision.json; last line one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
import time
from pathlib import Path

import torch

from miles.core.schema.trainer import CorrectionConfig
from miles.diffusion.config import DiffusionTrainerConfig, PrecisionConfig
from miles.diffusion.engine import DenoiseRequest, DiffusionEngine
from miles.diffusion.model import FlowUNet, FlowUNetSpec, load_weights
from miles.diffusion.precision import apply_precision, fp32_fraction
from miles.diffusion.pretrain import PretrainPlan, pretrain
from miles.diffusion.sampler import SDESchedule
from miles.diffusion.trainer import DiffusionBatch, DiffusionTrainer

REPO = Path(__file__).resolve().parent.parent
EMB = ["time_embed.*", "cond_embed.*"]
IO = ["conv_in.*", "conv_out.*", "norm_out.*"]
MODES = [  # (label, engine dtype, engine FP32 patterns, trainer dtype, trainer FP32 patterns)
    ("fp32", "float32", [], "float32", []),
    ("bf16", "bfloat16", [], "float32", []),
    ("bf16+fp32[emb]", "bfloat16", EMB, "float32", []),
    ("bf16+fp32[io]", "bfloat16", IO, "float32", []),
    ("bf16+fp32[emb,io]", "bfloat16", EMB + IO, "float32", []),
    ("bf16+fp32[emb,io] both sides", "bfloat16", EMB + IO, "bfloat16", EMB + IO),
    ("bf16 both sides", "bfloat16", [], "bfloat16", []),
]


async def engine_batch(net: FlowUNet, sched: SDESchedule, n: int) -> DiffusionBatch:
    eng = DiffusionEngine(net, sched, max_batch=n)
    try:
        res = await eng.denoise([DenoiseRequest(i % 4, 1000 + i) for i in range(n)])
    finally:
        await eng.close()
    return DiffusionBatch(
        torch.stack([torch.from_numpy(r.latents) for r in res]),
        torch.stack([torch.from_numpy(r.logprobs) for r in res]),
        torch.stack([torch.from_numpy(r.versions) for r in res]),
        torch.tensor([r.condition for r in res]), torch.zeros(n), torch.arange(n) // 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="", help="policy weights (safetensors); default: pretrain here")
    ap.add_argument("--pretrain-steps", type=int, default=400)
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8, help="SDE denoising steps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "diffusion_cpu.precision.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    if a.checkpoint:
        base = load_weights(a.checkpoint)
    else:
        base, _ = pretrain(FlowUNetSpec(), PretrainPlan(steps=a.pretrain_steps))
    sched = SDESchedule(a.steps, 0.7)
    rows = []
    for label, edt, epat, tdt, tpat in MODES:
        net = apply_precision(copy.deepcopy(base), getattr(torch, edt), epat)
        b = asyncio.run(engine_batch(net, sched, a.images))
        tr = DiffusionTrainer(DiffusionTrainerConfig(correction=CorrectionConfig(types=["tis"])),
                              PrecisionConfig(trainer_dtype=tdt, fp32_params=tpat), sched, base.spec,
                              base.state_dict())
        diff = (tr.logprobs(b) - b.rollout_logp).abs()
        rows.append({"mode": label, "engine_fp32_share": round(fp32_fraction(net), 4),
                     "mean_abs_diff": float(diff.mean()), "max_abs_diff": float(diff.max()),
                     "per_step_mean": [float(x) for x in diff.mean(0)]})
    print(f"{'mode':32s} {'fp32 share':>10s} {'mean |dlogp|':>13s} {'max |dlogp|':>12s}")
    for r in rows:
        print(f"{r['mode']:32s} {r['engine_fp32_share']:10.3f} {r['mean_abs_diff']:13.3e} {r['max_abs_diff']:12.3e}")
    by = {r["mode"]: r for r in rows}
    summary = {"bench": "diffusion_precision", "images": a.images, "denoising_steps": a.steps,
               "threads": a.threads, "seconds": round(time.perf_counter() - t0, 1),
               "checkpoint": a.checkpoint or f"pretrained here ({a.pretrain_steps} steps)",
               "fp32_mean_abs_diff": by["fp32"]["mean_abs_diff"],
               "fp32_max_abs_diff": by["fp32"]["max_abs_diff"],
               "bf16_mean_abs_diff": by["bf16"]["mean_abs_diff"],
               "per_param_fp32_mean_abs_diff": by["bf16+fp32[emb,io]"]["mean_abs_diff"],
               "fp32_goal_met": by["fp32"]["max_abs_diff"] <= 1e-5,
               "per_param_below_bf16": by["bf16+fp32[emb,io]"]["mean_abs_diff"] < by["bf16"]["mean_abs_diff"],
               "modes": rows}
    Path(a.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "modes"}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
