"""CPU train step of the quick start's shape: the chunked fused LM head vs the unfused one.

The quick start's trainer (tiny Qwen3-MoE, R3 replay, TIS, 512-token micro-batches, one
thread) on 8 groups x 8 samples of 8-12 prompt and 2-8 response tokens. Two trainers, one
per head, alternate steps so background load affects both alike; median step times.
The unfused head is the trainer's forward before the chunked head (logits at every
position, then fp32 log_softmax and entropy on the response rows). Last line: JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer import fsdp as fsdp_mod
from miles.trainer.fsdp import FSDPTrainer
from miles.trainer.synthetic import engine_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--vocab", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = ModelSpec.from_hf(tiny_config("qwen3_moe", vocab_size=args.vocab))
    batch = engine_batch(build_model(spec, seed=0), groups=8, group_size=8, prompt_len=(8, 13),
                         response_len=(2, 9))
    orig = fsdp_mod.packed_forward
    forwards = {"fused": orig, "unfused": functools.partial(orig, fused_head=False)}
    trainers = {}
    for name in forwards:
        cfg = TrainerConfig()
        cfg.routing_replay, cfg.micro_batch_tokens, cfg.optim.lr = True, 512, 1e-3
        cfg.correction.types = ["tis"]
        trainers[name] = FSDPTrainer(cfg, spec, 0, 1, seed=0)
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for i in range(args.steps + 1):
        for name, t in trainers.items():
            fsdp_mod.packed_forward = forwards[name]  # type: ignore[assignment]
            t0 = time.perf_counter()
            t.train_step(batch)
            if i:  # step 0 warms up
                times[name].append(time.perf_counter() - t0)
    fsdp_mod.packed_forward = orig  # type: ignore[assignment]
    for t in trainers.values():
        t.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{'head':<10}{'median ms':>12}{'min ms':>10}")
    for k, v in times.items():
        print(f"{k:<10}{med[k] * 1e3:>12.2f}{min(v) * 1e3:>10.2f}")
    print(json.dumps({"fused_step_ms": med["fused"] * 1e3, "unfused_step_ms": med["unfused"] * 1e3,
                      "fused_over_unfused": med["fused"] / med["unfused"], "tokens": batch.num_tokens}))


if __name__ == "__main__":
    main()
