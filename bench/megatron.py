"""Megatron-core backend vs FSDP2 on one GPU: agreement checks, then step time.

Checks (tiny dense Qwen3 and tiny Qwen3-MoE, same weights, same batch):
  logprobs  max / mean |megatron - fsdp| over response tokens, fp32 and bf16;
  loss      train/loss of two consecutive train_steps (the second after one AdamW update);
  r3        the embedded TorchEngine samples with routed-expert recording; megatron's
            router, replaying, must use exactly the recorded experts (and the live
            overlap without replay is reported);
  export    megatron's HF export loads into a TorchEngine (checkpoint and stage/commit);
            the engine's logprobs are compared with megatron's.
Timing: median train_step seconds of each backend on a ~0.5B dense and a small MoE model.

Needs CUDA and megatron-core (Python >= 3.12). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles.core.schema.engine import EngineConfig
from miles.core.schema.trainer import TrainerConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.hf_io import load_model
from miles.models.logprobs import token_logprobs
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.batch import TrainBatch, TrainSample
from miles.trainer.fsdp import FSDPTrainer
from miles.trainer.megatron.available import unavailable_reason
from miles.trainer.megatron.trainer import MegatronTrainer
from miles.trainer.packing import pack
from miles.trainer.synthetic import engine_batch
from trainer import CUDA_MODELS  # bench/ is on sys.path when this file runs as a script

TINY = {
    "dense": tiny_config("qwen3", vocab_size=512, num_hidden_layers=3),
    "moe": tiny_config("qwen3_moe", vocab_size=512, num_hidden_layers=3, num_experts=8,
                       num_experts_per_tok=2, mlp_only_layers=[1]),
}
# The step-time configs are bench/trainer.py's, so the two benches time the same models.
BIG = {name: tiny_config(**kw) for name, kw in CUDA_MODELS.items()}


def trainer_cfg(backend: str, dtype: str, micro_tokens: int = 1 << 16) -> TrainerConfig:
    cfg = TrainerConfig()
    cfg.backend = backend  # type: ignore[assignment]
    cfg.device = "cuda"
    cfg.param_dtype = dtype  # type: ignore[assignment]
    cfg.micro_batch_tokens = micro_tokens
    cfg.optim.lr = 1e-3
    cfg.megatron.transformer_impl = "local"  # the validated spec (TE is used by 'auto' when installed)
    return cfg


def make(backend: str, spec: ModelSpec, dtype: str, micro_tokens: int = 1 << 16) -> Any:
    cls = MegatronTrainer if backend == "megatron" else FSDPTrainer
    return cls(trainer_cfg(backend, dtype, micro_tokens), spec, 0, 1, seed=7)


def diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.float().cpu() - b.float().cpu()).abs()
    return float(d.max()), float(d.mean())


# Tolerances (see bench/gpu/README.md). fp32: both backends compute the same function in
# fp32 with different kernels (packed varlen vs padded rows, fused vs split projections);
# reordering sums leaves ~1e-6 relative error, so 1e-4 nats is tight. bf16: FSDP2 casts the
# parameters to bf16 (bf16 residual stream), megatron keeps fp32 weights and residual under
# autocast; bf16 keeps 8 significant bits, so each backend sits at its own rounding distance
# from the fp32 function and they are compared to it: megatron's bf16 error must be at most
# BF16_RATIO x FSDP2's (no worse than the validated backend), and |megatron - fsdp| within
# BF16_MAX_ABS nats (rounding noise through a few layers, far below a wrong-weights error ~1).
FP32_LOGP_TOL, FP32_LOSS_TOL, FP32_GRAD_REL_TOL = 1e-4, 1e-4, 1e-3
BF16_RATIO, BF16_MAX_ABS = 2.0, 0.1


def _policy_logp(t: Any, mb: Any, replay: bool) -> torch.Tensor:
    if isinstance(t, MegatronTrainer):
        return t.forward_micro_batch(mb, replay=replay).logp
    with torch.no_grad():
        return t.forward_model(t.policy, mb.to(t.device), temperature=1.0, replay=replay,
                          with_entropy=False).logp


def logprob_check(spec: ModelSpec, batch: TrainBatch, dtype: str) -> dict[str, Any]:
    f, m = make("fsdp", spec, dtype), make("megatron", spec, dtype)
    mb = pack(batch.samples, list(range(len(batch.samples))), replay=spec.is_moe)
    lf, lm = _policy_logp(f, mb, spec.is_moe), _policy_logp(m, mb, spec.is_moe)
    mx, mean = diff(lf, lm)
    out: dict[str, Any] = {"logp_max_abs": mx, "logp_mean_abs": mean}
    if dtype == "bfloat16":  # each backend's distance to the fp32 function
        ref = make("fsdp", spec, "float32")
        lr = _policy_logp(ref, mb, spec.is_moe)
        del ref
        out["fsdp_vs_fp32_max"], out["fsdp_vs_fp32_mean"] = diff(lf, lr)
        out["megatron_vs_fp32_max"], out["megatron_vs_fp32_mean"] = diff(lm, lr)
    losses = []
    for _ in range(2):
        a, b = f.train_step(batch), m.train_step(batch)
        losses.append((a["train/loss"], b["train/loss"], a["train/grad_norm"], b["train/grad_norm"]))
    for i, (a, b, ga, gb) in enumerate(losses):
        out[f"loss{i + 1}_fsdp"], out[f"loss{i + 1}_megatron"] = a, b
        out[f"loss{i + 1}_abs_diff"] = abs(a - b)
        out[f"grad_norm{i + 1}_fsdp"], out[f"grad_norm{i + 1}_megatron"] = ga, gb
        out[f"grad_norm{i + 1}_rel_diff"] = abs(ga - gb) / max(abs(ga), 1e-12)
    # the weights after two AdamW updates: the updates themselves agree
    out["logp_after_2_steps_max_abs"], out["logp_after_2_steps_mean_abs"] = diff(
        _policy_logp(f, mb, spec.is_moe), _policy_logp(m, mb, spec.is_moe))
    if dtype == "float32":
        out["pass"] = bool(mx < FP32_LOGP_TOL and out["logp_after_2_steps_max_abs"] < FP32_LOGP_TOL
                           and all(out[f"loss{i}_abs_diff"] < FP32_LOSS_TOL for i in (1, 2))
                           and all(out[f"grad_norm{i}_rel_diff"] < FP32_GRAD_REL_TOL for i in (1, 2)))
    else:
        out["pass"] = bool(mx < BF16_MAX_ABS and out["megatron_vs_fp32_mean"]
                           <= BF16_RATIO * out["fsdp_vs_fp32_mean"] + 1e-6)
    return out


async def _engine_samples(engine: TorchEngine, spec: ModelSpec, n: int) -> TrainBatch:
    rng = np.random.default_rng(0)
    samples = []
    for i in range(n):
        prompt = rng.integers(0, spec.vocab_size, int(rng.integers(5, 12))).tolist()
        res = await engine.generate(GenerateRequest(
            input_ids=prompt, return_routed_experts=True,
            sampling=SamplingParams(temperature=1.0, max_new_tokens=int(rng.integers(6, 16)), seed=i)))
        samples.append(TrainSample(
            prompt_ids=np.asarray(prompt), response_ids=np.asarray(res.output_ids),
            reward=float(i % 2), group_index=i // 4, rollout_logprobs=np.asarray(res.logprobs, np.float32),
            routed_experts=res.routed_experts, versions=np.zeros(len(res.output_ids), np.int64)))
    await engine.close()
    return TrainBatch(samples)


def engine_of(model: Any) -> TorchEngine:
    cfg = EngineConfig()
    cfg.cuda_graphs = False
    return TorchEngine(model, cfg)


def r3_check(spec: ModelSpec, dtype: str) -> dict[str, Any]:
    """Engine (same weights as the trainers' seed-7 init) records routes; megatron replays."""
    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    engine = engine_of(build_model(spec, seed=7, dtype=tdt, device="cuda"))
    batch = asyncio.run(_engine_samples(engine, spec, 12))
    m = make("megatron", spec, dtype)
    mb = pack(batch.samples, list(range(len(batch.samples))), replay=True)
    rec = mb.routed_experts.sort(-1).values
    valid = mb.route_valid
    out: dict[str, Any] = {"tokens": float(valid.sum())}
    for replay in (True, False):
        m.forward_micro_batch(mb, replay=replay)
        used = m.routing.used.cpu().sort(-1).values
        rows = (used == rec).all(-1)[valid]  # [tokens, layers] exact expert set per layer
        hit = (used[..., :, None] == rec[..., None, :]).any(-1).float().mean(-1)[valid]
        key = "replay" if replay else "live"
        out[f"{key}_exact_rows"] = float(rows.float().mean())
        out[f"{key}_overlap"] = float(hit.mean())
    lp = m.forward_micro_batch(mb).logp.cpu()
    rl = torch.from_numpy(np.concatenate([s.rollout_logprobs for s in batch.samples]))
    out["engine_vs_megatron_logp_max_abs"], out["engine_vs_megatron_logp_mean_abs"] = diff(lp, rl)
    out["pass"] = out["replay_exact_rows"] == 1.0
    return out


def export_check(spec: ModelSpec) -> dict[str, Any]:
    m = make("megatron", spec, "float32")
    batch = engine_batch(build_model(spec, seed=1), groups=2, group_size=3, seed=3)
    m.train_step(batch)  # export weights that differ from the initial ones
    mb = pack(batch.samples, list(range(len(batch.samples))), replay=False)
    lm = m.forward_micro_batch(mb, replay=False).logp
    with tempfile.TemporaryDirectory() as d:
        m.export_hf_checkpoint(d)
        model = load_model(d, dtype=torch.float32, device="cuda")
    eng = engine_of(model)
    staged = engine_of(build_model(spec, seed=99, device="cuda"))

    async def sync() -> None:
        await staged.stage(1, m.export_hf_state())
        await staged.commit(1)

    asyncio.run(sync())

    with torch.no_grad():
        logits = eng.model(mb.input_ids.cuda().unsqueeze(0), mb.position_ids.cuda().unsqueeze(0),
                           cu_seqlens=mb.cu_seqlens.cuda()).logits[0]
    le = token_logprobs(logits[mb.resp_pos.cuda()], mb.resp_targets.cuda(), 1.0)
    mx, mean = diff(le, lm)
    same = eng.checksums() == staged.checksums()
    return {"engine_logp_max_abs": mx, "engine_logp_mean_abs": mean, "stage_commit_equal": float(same),
            "pass": bool(same and mx < FP32_LOGP_TOL)}


def random_batch(spec: ModelSpec, groups: int, size: int, seq: int) -> TrainBatch:
    rng = np.random.default_rng(0)
    p_len, r_len = seq // 4, seq - seq // 4
    samples = []
    for g in range(groups):
        prompt = rng.integers(0, spec.vocab_size, p_len)
        for _ in range(size):
            routes = None
            if spec.is_moe:
                routes = np.argsort(rng.random((seq - 1, spec.num_moe_layers, spec.num_experts)), -1)[
                    ..., : spec.num_experts_per_tok].astype(np.uint8)
            samples.append(TrainSample(
                prompt_ids=prompt, response_ids=rng.integers(0, spec.vocab_size, r_len),
                reward=float(rng.integers(0, 2)), group_index=g,
                rollout_logprobs=np.full(r_len, -2.0, np.float32), routed_experts=routes,
                versions=np.zeros(r_len, np.int64)))
    return TrainBatch(samples)


def timed(t: Any, batch: TrainBatch, reps: int) -> float:
    t.train_step(batch)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        t.train_step(batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def guarded(res: dict[str, Any], key: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one check; a failure is recorded in the results (with its traceback printed) so
    the remaining checks still run on the device."""
    try:
        res[key] = fn()
    except Exception as exc:  # noqa: BLE001 - reported in the JSON and on stderr, not hidden
        traceback.print_exc()
        res[key] = {"error": f"{type(exc).__name__}: {exc}"}
    return res[key]


def main() -> int:
    # `python bench/megatron.py` puts bench/ first on sys.path, where this file would shadow
    # the `megatron` package (imported lazily, after this point)
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="check,time")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro-tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    why = unavailable_reason()
    if why is not None:
        print(json.dumps({"skipped": why}))
        return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "python": sys.version.split()[0]}
    rows: list[tuple[str, str, str]] = []
    if "check" in a.parts:
        for name, cfg in TINY.items():
            spec = ModelSpec.from_hf(cfg)
            batch = engine_batch(build_model(spec, seed=7), groups=3, group_size=4, seed=1)
            for dtype in ("float32", "bfloat16"):
                r = guarded(res, f"{name}_{dtype}",
                            lambda s=spec, b=batch, d=dtype: logprob_check(s, b, d))
                if "error" in r:
                    continue
                rows.append((f"{name} {dtype}", "logp max/mean |diff|",
                             f"{r['logp_max_abs']:.2e} / {r['logp_mean_abs']:.2e}"))
                if dtype == "bfloat16":
                    rows.append((f"{name} {dtype}", "mean |logp - fp32|: fsdp / megatron",
                                 f"{r['fsdp_vs_fp32_mean']:.2e} / {r['megatron_vs_fp32_mean']:.2e}"))
                rows.append((f"{name} {dtype}", "loss1 / loss2 |diff|",
                             f"{r['loss1_abs_diff']:.2e} / {r['loss2_abs_diff']:.2e}"))
                rows.append((f"{name} {dtype}", "grad_norm1 / 2 rel diff; logp after 2 steps",
                             f"{r['grad_norm1_rel_diff']:.1e} / {r['grad_norm2_rel_diff']:.1e}; "
                             f"{r['logp_after_2_steps_max_abs']:.2e}  pass={r['pass']}"))
        moe = ModelSpec.from_hf(TINY["moe"])
        for dtype in ("float32", "bfloat16"):
            r = guarded(res, f"r3_{dtype}", lambda d=dtype: r3_check(moe, d))
            if "error" in r:
                continue
            rows.append((f"moe {dtype}", "R3 replay exact / live overlap",
                         f"{r['replay_exact_rows']:.4f} / {r['live_overlap']:.4f}"))
        for name, cfg in TINY.items():
            r = guarded(res, f"export_{name}", lambda c=cfg: export_check(ModelSpec.from_hf(c)))
            if "error" in r:
                continue
            rows.append((name, "export -> engine logp max |diff|, stage==ckpt",
                         f"{r['engine_logp_max_abs']:.2e}, {bool(r['stage_commit_equal'])}"))
    if "time" in a.parts:
        for name, cfg in BIG.items():
            spec = ModelSpec.from_hf(cfg)
            batch = random_batch(spec, a.groups, a.group_size, a.seq)

            def run(s: ModelSpec = spec, b: TrainBatch = batch) -> dict[str, Any]:
                t: dict[str, Any] = {}
                for backend in ("fsdp", "megatron"):
                    tr = make(backend, s, "bfloat16", a.micro_tokens)
                    t[backend] = timed(tr, b, a.reps)
                    del tr
                    torch.cuda.empty_cache()
                t["megatron_over_fsdp"] = t["megatron"] / t["fsdp"]
                t["tokens"] = float(b.num_tokens)
                return t

            t = guarded(res, f"time_{name}", run)
            if "error" in t:
                continue
            rows.append((name, "step s fsdp / megatron (ratio)",
                         f"{t['fsdp']:.3f} / {t['megatron']:.3f} ({t['megatron_over_fsdp']:.2f}x)"))
    w = max(len(r[0]) for r in rows) if rows else 10
    for r in rows:
        print(f"{r[0]:<{w}}  {r[1]:<46} {r[2]}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
