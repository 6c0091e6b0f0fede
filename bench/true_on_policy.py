"""True on-policy mode: throughput of the batch-invariant engine and trainer vs the default.

Same model, same requests, same batches; engine tokens/s and trainer step time in both
modes (interleaved, medians), and the max |engine - trainer| logprob in each mode, for
each dtype (fp32 and bf16 by default) and model (dense; `--archs qwen3,qwen3_moe` adds a
MoE with R3 routing replay).

    python bench/true_on_policy.py [--device cuda] [--dtypes float32,bfloat16] [--archs qwen3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from miles.core.schema.engine import EngineConfig
from miles.core.schema.trainer import TrainerConfig
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.fsdp import FSDPTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "recipes"))
from rl_loop import prompts, rollout, sync, to_batch  # noqa: E402


async def _one(
    spec: ModelSpec, invariant: bool, device: str, n_prompts: int, dtype: str = "float32"
) -> dict[str, float]:
    cfg = TrainerConfig()
    cfg.device = device  # type: ignore[assignment]
    # bfloat16: the trainer computes in bf16 from fp32 masters; the engine holds the same
    # bf16-rounded weights (the sync casts), so equal kernels must give equal logprobs.
    cfg.param_dtype = dtype  # type: ignore[assignment]
    cfg.micro_batch_tokens = 512
    cfg.optim.lr = 1e-4
    cfg.true_on_policy = invariant
    trainer = FSDPTrainer(cfg, spec, 0, 1, seed=1)
    model = build_model(spec, dtype=getattr(torch, dtype), seed=1).to(device)
    engine = TorchEngine(
        model, EngineConfig(max_batch_size=16, device=device), batch_invariant=invariant
    )
    try:
        await sync(trainer, engine, 0)
        ps = prompts(spec.vocab_size, n_prompts, seed=0)
        t0 = time.perf_counter()
        res = await rollout(engine, ps, 4, run_seed=0, step=0, max_new=32, routes=spec.is_moe)
        dt_gen = time.perf_counter() - t0
        toks = sum(len(r.output_ids) for r in res)
        t0 = time.perf_counter()
        m = trainer.train_step(to_batch(ps, res, 4))
        dt_train = time.perf_counter() - t0
    finally:
        await engine.close()
        trainer.close()
    return {
        "gen_tokens_per_s": toks / dt_gen,
        "train_step_s": dt_train,
        "max_abs_diff": m["train/train_rollout_logprob_abs_diff_max"],
    }


def _spec(arch: str) -> ModelSpec:
    extra = {"num_experts": 16, "moe_intermediate_size": 128} if arch == "qwen3_moe" else {}
    return ModelSpec.from_hf(
        tiny_config(arch, vocab_size=512, hidden_size=128, num_hidden_layers=2, **extra)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="discarded runs per model and dtype")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma list")
    ap.add_argument("--archs", default="qwen3", help="comma list of tiny presets")
    args = ap.parse_args()
    print(
        f"{'model':<11}{'dtype':<10}{'mode':<16}{'gen tok/s':>12}{'train step s':>14}"
        f"{'max |dlogp|':>14}"
    )
    out: dict[str, object] = {"device": args.device}
    for arch in args.archs.split(","):
        spec = _spec(arch)
        for dtype in args.dtypes.split(","):
            runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
            for _ in range(args.warmup):  # first-use kernel setup (cuBLAS, bf16 paths) is not cost
                for inv in (False, True):
                    asyncio.run(_one(spec, inv, args.device, args.prompts, dtype))
            for _ in range(args.repeats):
                for inv in (False, True):
                    runs[inv].append(
                        asyncio.run(_one(spec, inv, args.device, args.prompts, dtype))
                    )
            med = {
                inv: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                for inv, rs in runs.items()
            }
            for inv, name in ((False, "default"), (True, "true on-policy")):
                r = med[inv]
                print(
                    f"{arch:<11}{dtype:<10}{name:<16}{r['gen_tokens_per_s']:>12.1f}"
                    f"{r['train_step_s']:>14.3f}{r['max_abs_diff']:>14.3g}"
                )
            tag = f"{arch}_{dtype}"
            out[tag] = {
                "gen_throughput_ratio": med[True]["gen_tokens_per_s"]
                / med[False]["gen_tokens_per_s"],
                "train_time_ratio": med[True]["train_step_s"] / med[False]["train_step_s"],
                "max_abs_diff_default": med[False]["max_abs_diff"],
                # the worst over every repeat, not the median: exactness must hold each time
                "max_abs_diff_true_on_policy": max(r["max_abs_diff"] for r in runs[True]),
            }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
