"""Trainer throughput: tokens/s of FSDPTrainer.train_step, with and without R3 replay.

CPU (default): a tiny MoE model, one rank (gloo). R3 overhead = fractional step-time
increase of replay over live routing on the same batch (goal <= 5%).
--device cuda: a ~0.5B dense and a small MoE config in bf16, a realistic step (default 8 x 4
sequences of ~768 tokens, ~25k tokens; packed micro-batches of 4k tokens), packed attention
masked (one call over the pack, block-diagonal bias) vs varlen (one flash call per sequence).
MFU, counted the standard way: 6 x non-embedding active parameters per token (the LM head
GEMM included, the embedding lookup not) plus causal attention (12 x layers x heads x
head_dim x mean context), over the peak measured by a bf16
8192^3 GEMM on the same GPU (reported; --peak-tflops overrides). The older count (6 x all
active parameters, embedding and LM head included, no attention) is kept as `mfu_old`.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.models.logprobs import token_logprobs
from miles.models.moe import compact_expert_ids
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.batch import TrainBatch, TrainSample
from miles.trainer.fsdp import FSDPTrainer
from miles.trainer.synthetic import engine_batch

CUDA_MODELS = {
    "dense_0.5b": dict(
        arch="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=151936,
    ),
    "moe_small": dict(
        arch="qwen3_moe",
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=32000,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=512,
    ),
}


def _spec(arch: str, **kw: object) -> ModelSpec:
    return ModelSpec.from_hf(tiny_config(arch, **kw))  # type: ignore[arg-type]


def _flops_per_token(spec: ModelSpec) -> float:
    """Training FLOPs per token (6 x active params, attention ignored: short sequences)."""
    h, layers = spec.hidden_size, spec.num_layers
    attn = (
        h * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        + spec.num_heads * spec.head_dim * h
    )
    dense_mlp = 3 * h * spec.intermediate_size
    moe_mlp = 3 * h * spec.moe_intermediate_size * spec.num_experts_per_tok + h * spec.num_experts
    mlp = sum(moe_mlp if i in spec.moe_layers else dense_mlp for i in range(layers))
    return 6.0 * (layers * attn + mlp + 2 * h * spec.vocab_size)


def _flops_per_token_std(spec: ModelSpec, seq: int) -> float:
    """6 x non-embedding active parameters + causal attention (mean context (seq+1)/2)."""
    h = spec.hidden_size
    layer_params = _flops_per_token(spec) / 6.0 - 2 * h * spec.vocab_size  # without embedding and head
    attn = 12.0 * spec.num_layers * spec.num_heads * spec.head_dim * (seq + 1) / 2
    # the LM head is a GEMM (counted); the embedding is a lookup (not)
    return 6.0 * (layer_params + h * spec.vocab_size) + attn


def measured_peak_tflops(n: int = 8192, reps: int = 20) -> float:
    """bf16 GEMM rate of this GPU (the denominator of MFU)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def _trainer(spec: ModelSpec, mode: tuple[bool, str], device: str, args: argparse.Namespace) -> FSDPTrainer:
    replay, packed = mode
    cfg = TrainerConfig()
    cfg.device = device  # type: ignore[assignment]
    cfg.packed_attention = packed  # type: ignore[assignment]
    cfg.routing_replay = replay
    cfg.micro_batch_tokens = args.micro_tokens
    cfg.optim.lr = 1e-5
    return FSDPTrainer(cfg, spec, 0, 1, seed=0)


def _timed(t: FSDPTrainer, batch: TrainBatch, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    t.train_step(batch)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


@torch.no_grad()
def _device_batch(model: CausalLM, groups: int, group_size: int, seq: int, seed: int = 0) -> TrainBatch:
    """Like `engine_batch`, scored on the model's own device (the CPU is far too slow for ~32k
    tokens of a 0.5B model): prompts of seq/4 and responses of seq/2 random tokens."""
    spec, dev = model.spec, next(model.parameters()).device
    rng = np.random.default_rng(seed)
    p_len, r_len = seq // 4, seq // 2
    samples = []
    for g in range(groups):
        prompt = rng.integers(0, spec.vocab_size, p_len)
        resp = rng.integers(0, spec.vocab_size, (group_size, r_len))
        ids = torch.from_numpy(np.concatenate([np.tile(prompt, (group_size, 1)), resp], axis=1)).to(dev)
        out = model(ids, return_routed_experts=spec.is_moe)
        lp = token_logprobs(out.logits[:, p_len - 1 : -1], ids[:, p_len:], 1.0).float().cpu()
        for i in range(group_size):
            routes = None
            if out.routed_experts is not None:
                routes = compact_expert_ids(out.routed_experts[i, :-1], spec.num_experts)
            samples.append(TrainSample(
                prompt_ids=prompt, response_ids=resp[i], reward=float(rng.integers(0, 2)), group_index=g,
                rollout_logprobs=lp[i].numpy(), routed_experts=routes, versions=np.zeros(r_len, np.int64),
            ))
    return TrainBatch(samples)


def _compare(
    spec: ModelSpec, device: str, args: argparse.Namespace, modes: tuple[tuple[bool, str], ...]
) -> tuple[dict[tuple[bool, str], float], int]:
    """Median step time per routing mode; steps alternate between modes so that load from
    other processes affects both alike."""
    if device == "cpu":
        batch = engine_batch(
            build_model(spec, seed=0),
            groups=args.groups,
            group_size=args.group_size,
            prompt_len=(args.seq // 4, args.seq // 4 + 1),
            response_len=(args.seq // 2, args.seq // 2 + 1),
        )
    else:
        eng = build_model(spec, seed=0, dtype=torch.bfloat16, device=device)
        batch = _device_batch(eng, args.groups, args.group_size, args.seq)
        del eng
        torch.cuda.empty_cache()
    trainers = {m: _trainer(spec, m, device, args) for m in modes}
    for t in trainers.values():
        t.train_step(batch)  # warm-up
    times: dict[tuple[bool, str], list[float]] = {m: [] for m in modes}
    for _ in range(args.steps):
        for m, t in trainers.items():
            times[m].append(_timed(t, batch, device))
    for t in trainers.values():
        t.close()
    return {m: statistics.median(v) for m, v in times.items()}, batch.num_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=None, help="timed steps per mode (cpu 8, cuda 4)")
    ap.add_argument("--groups", type=int, default=None, help="cpu 4, cuda 8")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (cpu 64, cuda 1024)")
    ap.add_argument("--micro-tokens", type=int, default=None, help="cpu 512, cuda 4096")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="0 = measure a bf16 GEMM")
    args = ap.parse_args()
    gpu = args.device == "cuda"
    args.steps = args.steps or (4 if gpu else 8)
    args.groups = args.groups or (8 if gpu else 4)
    args.seq = args.seq or (1024 if gpu else 64)
    args.micro_tokens = args.micro_tokens or (4096 if gpu else 512)
    result: dict[str, float] = {}
    rows = []
    if args.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
        spec = _spec("qwen3_moe", vocab_size=512, hidden_size=128, num_hidden_layers=2)
        times, n = _compare(spec, "cpu", args, ((False, "auto"), (True, "auto")))
        live, r3 = times[(False, "auto")], times[(True, "auto")]
        rows.append(("cpu tiny-moe", "live", n / live, live))
        rows.append(("cpu tiny-moe", "R3", n / r3, r3))
        result["cpu_tokens_per_s"] = n / r3
        result["cpu_tokens_per_s_live"] = n / live
        result["cpu_r3_overhead"] = r3 / live - 1.0
    else:
        peak = args.peak_tflops or measured_peak_tflops()
        result["peak_tflops_measured_gemm"] = peak
        print(f"peak: {peak:.0f} TFLOP/s (bf16 8192^3 GEMM{', given' if args.peak_tflops else ', measured'})")
        for name, kw in CUDA_MODELS.items():
            kw = dict(kw)
            spec = _spec(str(kw.pop("arch")), **kw)
            modes = (((False, "masked"), (False, "varlen"), (True, "varlen")) if spec.is_moe
                     else ((False, "masked"), (False, "varlen")))
            times, n = _compare(spec, "cuda", args, modes)
            seq = args.seq * 3 // 4  # prompt seq/4 + response seq/2
            for mode in modes:
                dt = times[mode]
                tag = f"{'r3' if mode[0] else 'live'}_{mode[1]}"
                rows.append((name, tag, n / dt, dt, n * _flops_per_token_std(spec, seq) / dt / (peak * 1e12)))
                result[f"{name}_{tag}_tokens_per_s"] = n / dt
                result[f"{name}_{tag}_mfu"] = n * _flops_per_token_std(spec, seq) / dt / (peak * 1e12)
                result[f"{name}_{tag}_mfu_old"] = n * _flops_per_token(spec) / dt / (780.0 * 1e12)
            if (True, "varlen") in times:
                result[f"{name}_r3_overhead"] = times[(True, "varlen")] / times[(False, "varlen")] - 1.0
    print(f"{'model':<16}{'mode':<16}{'tokens/s':>12}{'step s':>10}{'MFU':>8}")
    for name, mode, tps, dt, *mfu in rows:
        print(f"{name:<16}{mode:<16}{tps:>12.1f}{dt:>10.3f}" + (f"{mfu[0]:>8.3f}" if mfu else ""))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
