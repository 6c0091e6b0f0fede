"""2-rank FSDP2 step (NCCL, one GPU each) vs 1-rank step on the same global batch, and tokens/s.

Each run starts from the same seeded weights and trains one RL step on the same global
batch (the 2-rank run gives each rank its `shard_batch` half). Compared: the globally
reduced metrics, and the first AdamW update of every weight, Delta w / lr.

Tolerance (bf16 on cuda): forward/backward run in bf16 (unit roundoff 2^-8 ~ 0.4%) with fp32
matmul accumulation, fp32 master weights and fp32 gradient reduce-scatter. The two runs pack
different micro-batches per rank, so GEMM shapes and summation orders differ and every bf16
rounding can land differently; those errors are independent per token and average out in
the batch-level loss and gradient norm, so those must agree within 2% (rel, plus 1e-3 abs for
values near zero). The first AdamW step moves each weight by ~lr * sign(grad) whatever the
gradient's size (m/sqrt(v) = g/|g|), so Delta w / lr compares gradient signs: only entries
whose gradient is within bf16 noise of zero may flip, and the cosine of the two update vectors
must be >= 0.98 (<= ~1% of the update mass flipped). On cpu (fp32) the bounds are 1e-4 and
0.9999. Timing: further steps on the same batch after the compared one, best of --steps.

Usage: python bench/multi_gpu/fsdp_2gpu.py --device cuda --out result.json   (last line: JSON)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from workers import run_workers  # this folder is on sys.path: the scripts run directly

from miles.core.ports import group_port
from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.batch import TrainBatch, shard_batch
from miles.trainer.fsdp import FSDPTrainer
from miles.trainer.synthetic import engine_batch

BENCH = Path(__file__).resolve().parent.parent
CUDA_MODEL = dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936)
METRICS = ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy")
LR = 1e-5


def _bench_trainer() -> Any:
    """bench/trainer.py, for its on-device batch builder (scores ~25k tokens on the GPU)."""
    spec = importlib.util.spec_from_file_location("bench_trainer", BENCH / "trainer.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _setup(a: argparse.Namespace) -> tuple[ModelSpec, TrainBatch, TrainerConfig]:
    cfg = TrainerConfig()
    cfg.device = a.device
    cfg.world_size = a.world
    cfg.optim.lr = LR
    cfg.optim.grad_clip = 0.0
    if a.device == "cuda":
        spec = ModelSpec.from_hf(tiny_config(**CUDA_MODEL))  # type: ignore[arg-type]
        dev = torch.device("cuda", a.rank)
        eng = build_model(spec, seed=5, dtype=torch.bfloat16, device=dev)
        batch = _bench_trainer()._device_batch(eng, a.groups, 4, a.seq, seed=2)
        del eng
        torch.cuda.empty_cache()
        cfg.micro_batch_tokens = 4096
    else:
        spec = ModelSpec.from_hf(tiny_config("qwen3_moe", vocab_size=96))
        batch = engine_batch(build_model(spec, seed=5), groups=4, group_size=2, seed=2)
        cfg.micro_batch_tokens = 24
    return spec, batch, cfg


def _state(t: FSDPTrainer, keep: bool) -> dict[str, torch.Tensor]:
    """Drain the (collective) export on every rank; rank 0 keeps float32 copies."""
    return {k: v.detach().float().clone() for k, v in t.export_hf_state() if keep}


def worker(a: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), LOCAL_RANK=str(a.rank))
    spec, batch, cfg = _setup(a)
    trainer = FSDPTrainer(cfg, spec, a.rank, a.world, seed=7)
    shard = shard_batch(batch, a.world)[a.rank]
    before = _state(trainer, a.rank == 0)
    first = trainer.train_step(shard)
    after = _state(trainer, a.rank == 0)
    times = []
    for _ in range(a.steps):
        if a.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.train_step(shard)
        if a.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if a.rank == 0:
        delta = {k: ((after[k] - before[k]) / LR).to(torch.bfloat16).cpu().contiguous() for k in before}
        save_file(delta, os.path.join(a.parts, f"delta_w{a.world}.safetensors"))
        Path(a.parts, f"metrics_w{a.world}.json").write_text(json.dumps({
            "first": first, "step_s": times, "tokens": first["train/tokens"],
            "params": sum(v.numel() for v in before.values())}))


def _launch(a: argparse.Namespace, world: int) -> None:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               OMP_NUM_THREADS="1" if a.device == "cpu" else "4", PYTHONWARNINGS="ignore")
    port = str(group_port())
    argv = [sys.executable, __file__, "--device", a.device, "--world", str(world), "--port", port,
            "--parts", a.parts, "--steps", str(a.steps), "--groups", str(a.groups), "--seq", str(a.seq)]
    run_workers([[*argv, "--rank", str(r)] for r in range(world)], env, a.timeout,
                f"{world}-rank FSDP workers")


def compare(parts: str, device: str) -> dict[str, Any]:
    m = {w: json.loads(Path(parts, f"metrics_w{w}.json").read_text()) for w in (1, 2)}
    d1, d2 = (load_file(str(Path(parts, f"delta_w{w}.safetensors"))) for w in (1, 2))
    rel, cos_min = (2e-2, 0.98) if device == "cuda" else (1e-4, 0.9999)
    metrics = {}
    for k in METRICS:
        x, y = m[1]["first"][k], m[2]["first"][k]
        metrics[k] = {"one_gpu": x, "two_gpu": y, "abs_diff": abs(x - y),
                      "ok": abs(x - y) <= rel * max(abs(x), abs(y)) + (1e-3 if device == "cuda" else 1e-6)}
    dot = n1 = n2 = 0.0
    flipped = total = 0
    worst = ("", 1.0)
    for k in d1:
        a, b = d1[k].double().reshape(-1), d2[k].double().reshape(-1)
        dot += float(a @ b)
        n1 += float(a @ a)
        n2 += float(b @ b)
        flipped += int(((a * b) < 0).sum())
        total += a.numel()
        c = float(a @ b) / max((float(a @ a) * float(b @ b)) ** 0.5, 1e-30)
        if c < worst[1]:
            worst = (k, c)
    cos = dot / max((n1 * n2) ** 0.5, 1e-30)
    tok = m[1]["tokens"]
    s1, s2 = min(m[1]["step_s"]), min(m[2]["step_s"])
    return {"metrics": metrics, "update_cosine": round(cos, 6), "update_cosine_min_tensor": [worst[0], round(worst[1], 6)],
            "update_sign_flips": flipped, "update_elements": total, "params": m[1]["params"],
            "tolerance": {"metric_rel": rel, "update_cosine_min": cos_min},
            "equal_within_tolerance": all(v["ok"] for v in metrics.values()) and cos >= cos_min,
            "tokens_per_step": tok, "one_gpu_step_s": s1, "two_gpu_step_s": s2,
            "one_gpu_tok_s": round(tok / s1, 1), "two_gpu_tok_s": round(tok / s2, 1),
            "scaling": round(s1 / s2, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the compared one")
    ap.add_argument("--groups", type=int, default=8, help="cuda: groups of 4 sequences in the global batch")
    ap.add_argument("--seq", type=int, default=768, help="cuda: tokens per sequence")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds for each launch")
    ap.add_argument("--out", default="fsdp_2gpu.json")
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--parts", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank >= 0:
        worker(a)
        return
    a.parts = str(Path(a.out).with_suffix(".parts"))
    Path(a.parts).mkdir(parents=True, exist_ok=True)
    for world in (1, 2):
        _launch(a, world)
    res = compare(a.parts, a.device)
    print(f"{'metric':18s} {'1 GPU':>12s} {'2 GPU':>12s} {'ok':>4s}")
    for k, v in res["metrics"].items():
        print(f"{k:18s} {v['one_gpu']:12.6g} {v['two_gpu']:12.6g} {v['ok']!s:>4s}")
    print(f"update cosine {res['update_cosine']:.6f} (min {res['tolerance']['update_cosine_min']}); "
          f"sign flips {res['update_sign_flips']}/{res['update_elements']}")
    print(f"tok/s: 1 GPU {res['one_gpu_tok_s']}, 2 GPU {res['two_gpu_tok_s']}, scaling {res['scaling']}x "
          f"({res['tokens_per_step']} tokens a step)")
    result = {"bench": "fsdp_2gpu", "device": a.device, "model": CUDA_MODEL if a.device == "cuda" else "tiny qwen3_moe",
              "dtype": "bfloat16" if a.device == "cuda" else "float32", "lr": LR, **res}
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
