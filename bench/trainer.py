"""Trainer throughput: tokens/s of FSDPTrainer.train_step, with and without R3 replay.

CPU (default): a tiny MoE model, one rank (gloo). R3 overhead = fractional step-time
increase of replay over live routing on the same batch (goal <= 5%).
--device cuda: a ~0.5B dense and a small MoE config in bf16, one optimizer step over a fixed
token budget (default 32k tokens: groups of 4 sequences of `--seqs` tokens each, a quarter
prompt, the rest response), packed into micro-batches of `--micro-tokens` (default 16k),
for every sequence length in `--seqs` (default 1024,2048,4096). MoE runs with live routing
and with R3 replay (the same batch; R3 overhead = step-time ratio - 1). Packed attention is
the trainer's default ("auto": varlen at these pack sizes). The head is the chunked fused
one and MoE experts the grouped GEMM (models/chunked_logprobs.py, models/grouped_moe.py);
Attention over a pack is one flash varlen call (models/flash_varlen.py) when torch has it and
it agrees with the per-sequence loop on this GPU (checked first; else the loop).
`--baseline` adds, at the first length, the unfused head, the per-sequence attention loop and
4k-token packs masked vs varlen (dense), and the per-expert loop (MoE) for comparison, `--profile` a CUDA-time table of one
step per model, `--compile` then the live runs with `CausalLM.compile_blocks()` (fused norms,
residuals, dense SwiGLU and the chunked head's softmax math; compile time reported apart).
MFU, counted the standard way: 6 x non-embedding active parameters per token (the LM head
GEMM included, the embedding lookup not) plus causal attention (12 x layers x heads x
head_dim x mean context), over the peak measured by a bf16 8192^3 GEMM on the same GPU
(reported; --peak-tflops overrides). The head counts only for the response tokens (the
step needs no other logits, and the chunked head computes none); `*_mfu_head_all_tokens`
counts it for every token, as pretraining MFU does (and as this bench did before).
Each mode also reports its median process CPU seconds per step (`*_host_cpu_s`) and the run its
host's CPU model: where the CPU time nears the step time the step is launch-bound, and the same
command then measures differently on a different host (26-36 % dense MFU on three H200 hosts).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from miles.core.schema.trainer import TrainerConfig
from miles.models import flash_varlen
from miles.models.chunked_logprobs import chunked_head_logprobs
from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.models.logprobs import token_logprobs
from miles.models.moe import Experts, compact_expert_ids
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.models.varlen import PackedSeqs, packed_causal_attention
from miles.trainer import fsdp as fsdp_mod
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


SMOKE_MODELS = {
    "dense_0.5b": dict(arch="qwen2", vocab_size=256),
    "moe_small": dict(arch="qwen3_moe", vocab_size=256, hidden_size=64, moe_intermediate_size=32),
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


def _flops_per_token_std(spec: ModelSpec, seq: int, head_frac: float = 1.0) -> float:
    """6 x non-embedding active parameters + causal attention (mean context (seq+1)/2). The LM
    head is a GEMM (counted) over the `head_frac` of tokens whose logits the step needs (RL:
    the response tokens; the chunked head computes no others); the embedding is a lookup (not)."""
    h = spec.hidden_size
    layer_params = _flops_per_token(spec) / 6.0 - 2 * h * spec.vocab_size  # without embedding and head
    attn = 12.0 * spec.num_layers * spec.num_heads * spec.head_dim * (seq + 1) / 2
    return 6.0 * (layer_params + head_frac * h * spec.vocab_size) + attn


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


def _trainer(spec: ModelSpec, mode: tuple[bool, str], device: str, args: argparse.Namespace,
             before: bool = False) -> FSDPTrainer:
    """A trainer at the user's defaults; `before` = issue 27's previous defaults (no compile,
    one-tensor-at-a-time AdamW), for the same-run comparison."""
    replay, packed = mode
    cfg = TrainerConfig()
    if before:
        cfg.compile = "off"
        cfg.optim.impl = "single"
    cfg.device = device  # type: ignore[assignment]
    cfg.packed_attention = packed  # type: ignore[assignment]
    cfg.routing_replay = replay
    cfg.micro_batch_tokens = args.micro_tokens
    cfg.recompute = args.recompute
    cfg.optim.lr = 1e-5
    return FSDPTrainer(cfg, spec, 0, 1, seed=0)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(t: FSDPTrainer, batch: TrainBatch) -> float:
    _sync()
    t0 = time.perf_counter()
    t.train_step(batch)
    _sync()
    return time.perf_counter() - t0


@torch.no_grad()
def _device_batch(model: CausalLM, groups: int, group_size: int, seq: int, seed: int = 0) -> TrainBatch:
    """Like `engine_batch`, scored on the model's own device (the CPU is far too slow for ~32k
    tokens of a 0.5B model): prompts of seq/4 and responses of the rest, random tokens."""
    spec, dev = model.spec, next(model.parameters()).device
    rng = np.random.default_rng(seed)
    p_len = seq // 4
    r_len = seq - p_len
    samples = []
    for g in range(groups):
        prompt = rng.integers(0, spec.vocab_size, p_len)
        resp = rng.integers(0, spec.vocab_size, (group_size, r_len))
        ids = torch.from_numpy(np.concatenate([np.tile(prompt, (group_size, 1)), resp], axis=1)).to(dev)
        pos = (torch.arange(group_size, device=dev)[:, None] * seq + torch.arange(p_len - 1, seq - 1, device=dev))
        out = model(ids, return_routed_experts=spec.is_moe, logits_index=pos.reshape(-1),
                    target_ids=ids[:, p_len:].reshape(-1))
        assert out.logprobs is not None
        lp = out.logprobs.view(group_size, r_len).float().cpu()
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
    spec: ModelSpec, args: argparse.Namespace, modes: tuple[tuple[bool, str], ...]
) -> tuple[dict[tuple[bool, str], float], int]:
    """CPU: median step time per routing mode; steps alternate between modes so that load from
    other processes affects both alike."""
    batch = engine_batch(
        build_model(spec, seed=0),
        groups=args.groups,
        group_size=args.group_size,
        prompt_len=(args.seq // 4, args.seq // 4 + 1),
        response_len=(args.seq // 2, args.seq // 2 + 1),
    )
    trainers = {m: _trainer(spec, m, "cpu", args) for m in modes}
    for t in trainers.values():
        t.train_step(batch)  # warm-up
    times: dict[tuple[bool, str], list[float]] = {m: [] for m in modes}
    for _ in range(args.steps):
        for m, t in trainers.items():
            times[m].append(_timed(t, batch))
    for t in trainers.values():
        t.close()
    return {m: statistics.median(v) for m, v in times.items()}, batch.num_tokens


def _set_experts(t: FSDPTrainer, impl: str) -> None:
    for m in t.policy.modules():
        if isinstance(m, Experts):
            m.impl = impl


@contextlib.contextmanager
def _unfused_head() -> Iterator[None]:
    """The trainer's forward as before the chunked head: logits [N, V] at every position, then
    fp32 log_softmax / entropy on the response rows (a bench-only swap of the function)."""
    orig = fsdp_mod.packed_forward
    fsdp_mod.packed_forward = functools.partial(orig, fused_head=False)  # type: ignore[assignment]
    try:
        yield
    finally:
        fsdp_mod.packed_forward = orig  # type: ignore[assignment]


def _steps(trainers: dict[str, FSDPTrainer], batch: TrainBatch, steps: int,
           host_cpu: dict[str, float] | None = None) -> dict[str, float]:
    """Median step time per trainer after one warm-up step each at this batch's shapes; steps
    alternate between trainers so that any drift affects all alike. `host_cpu` gets each
    trainer's median process CPU seconds per step: near the wall time, the step is bound by
    the host launching kernels, and its speed follows the host's CPU."""
    for t in trainers.values():
        t.train_step(batch)
    times: dict[str, list[float]] = {k: [] for k in trainers}
    cpu: dict[str, list[float]] = {k: [] for k in trainers}
    for _ in range(steps):
        for k, t in trainers.items():
            c0 = time.process_time()
            times[k].append(_timed(t, batch))
            cpu[k].append(time.process_time() - c0)
    if host_cpu is not None:
        host_cpu.update({k: statistics.median(v) for k, v in cpu.items()})
    return {k: statistics.median(v) for k, v in times.items()}


def host_description() -> str:
    """The CPU model and core count: the same GPU step measured 26-36 % MFU on different hosts."""
    model = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} cores"


def _profile(t: FSDPTrainer, batch: TrainBatch, label: str, result: dict[str, float]) -> None:
    """One step under the profiler: the ops with the most CUDA time (self), to see what limits;
    and, in a plain step, how long the clip + optimizer step takes (synchronised around it)."""
    from torch.profiler import ProfilerActivity, profile

    inner = t.clip_and_step
    spent: list[float] = []

    def timed_step() -> float:
        _sync()
        t0 = time.perf_counter()
        norm = inner()
        _sync()
        spent.append(time.perf_counter() - t0)
        return norm

    t.clip_and_step = timed_step  # type: ignore[method-assign]
    total = _timed(t, batch)
    del t.clip_and_step
    result[f"{label.replace(' ', '_')}_optimizer_step_s"] = sum(spent)
    result[f"{label.replace(' ', '_')}_step_s_with_optimizer_timed"] = total
    print(f"## {label}: clip + optimizer step {sum(spent) * 1e3:.1f} ms of a {total * 1e3:.1f} ms step")

    _sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        t.train_step(batch)
        _sync()
    print(f"## profile: {label} (one step, top ops by self CUDA time)")
    avg = prof.key_averages()
    try:
        print(avg.table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=60))
    except (AttributeError, KeyError, ValueError):
        print(avg.table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60))


def _checks(result: dict[str, float], dev: str, small: bool) -> None:
    """On this GPU, in bf16: the grouped-GEMM experts against the per-expert loop (forward and
    gradients) and the chunked head against the unfused logprobs, as relative max errors."""
    g = torch.Generator().manual_seed(0)
    e, h, i, n, k = (8, 64, 32, 128, 2) if small else (32, 1024, 512, 4096, 4)
    ex = Experts(e, h, i).to(dev)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.02)
        ex.down_proj.normal_(0, 0.02)
    ex = ex.to(torch.bfloat16)
    ids = torch.randint(0, e, (n, k), generator=g).to(dev)
    x0 = torch.randn(n, h, generator=g).to(dev, torch.bfloat16)
    w0 = torch.rand(n, k, generator=g).to(dev, torch.bfloat16)
    got = {}
    for impl in ("loop", "grouped_mm"):
        ex.impl = impl
        ex.zero_grad()
        x = x0.clone().requires_grad_(True)
        y = ex(x, ids, w0)
        (y.float() * torch.linspace(-1, 1, y.numel(), device=dev).view_as(y)).sum().backward()
        got[impl] = (y.detach().float(), x.grad.float(), ex.gate_up_proj.grad.float(), ex.down_proj.grad.float())
    for name, a, b in zip(("out", "grad_x", "grad_gate_up", "grad_down"), got["grouped_mm"], got["loop"], strict=True):
        result[f"check_grouped_mm_vs_loop_{name}_rel"] = float((a - b).abs().max() / b.abs().max())
    m, hd, v = (64, 32, 1000) if small else (2048, 896, 151936)
    hid = (torch.randn(m, hd, generator=g) * 2).to(dev, torch.bfloat16)
    wt = (torch.randn(v, hd, generator=g) * 0.05).to(dev, torch.bfloat16)
    tgt = torch.randint(0, v, (m,), generator=g).to(dev)
    fused, ent = chunked_head_logprobs(hid, wt, tgt, 1.0, entropy=True)
    logits = hid @ wt.t()
    ref = token_logprobs(logits, tgt, 1.0)
    lse_ent = -(torch.log_softmax(logits.float(), -1).exp() * torch.log_softmax(logits.float(), -1)).sum(-1)
    assert ent is not None
    result["check_chunked_head_logp_maxabs"] = float((fused - ref).abs().max())
    result["check_chunked_head_entropy_maxabs"] = float((ent - lse_ent).abs().max())
    if dev == "cuda":
        _check_flash_varlen(result, g)
    print("checks: " + ", ".join(f"{kk}={vv:.2e}" for kk, vv in result.items() if kk.startswith("check_")))


def _check_flash_varlen(result: dict[str, float], g: torch.Generator) -> None:
    """The one-call flash varlen attention against the per-sequence loop (forward, grads). If
    it is unavailable, raises, or disagrees, the runs below use the loop (and say so)."""
    lens = [1000, 24, 2048, 1024]
    t, seqs = sum(lens), PackedSeqs.of(torch.tensor([0, *np.cumsum(lens).tolist()]))
    q0 = torch.randn(1, 14, t, 64, generator=g).to("cuda", torch.bfloat16)
    k0 = torch.randn(1, 2, t, 64, generator=g).to("cuda", torch.bfloat16)
    v0 = torch.randn(1, 2, t, 64, generator=g).to("cuda", torch.bfloat16)
    ok = False
    try:
        used = flash_varlen.flash_packed_attention(q0, k0, v0, seqs.bounds, 0.125) is not None
        got = {}
        for on in (True, False):
            flash_varlen.ENABLED = on
            q, k, v = (x.clone().requires_grad_(True) for x in (q0, k0, v0))
            out = packed_causal_attention(q, k, v, seqs, 0.125)
            (out.float() * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
            got[on] = [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]
        errs = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got[True], got[False], strict=True)]
        result["check_flash_varlen_vs_loop_rel"] = max(errs)
        ok = used and max(errs) < 2e-2
    except Exception as exc:  # noqa: BLE001 - any failure of the optional kernel means: use the loop
        print(f"flash varlen attention failed, using the per-sequence loop: {exc!r}")
    flash_varlen.ENABLED = ok
    result["flash_varlen_used"] = float(ok)


def _baselines(spec: ModelSpec, t: FSDPTrainer, batch: TrainBatch, seq: int, args: argparse.Namespace,
               record: Callable[[str, int, float, int], None]) -> None:
    """The same step through the older paths: the per-expert loop (MoE); the unfused head and
    the per-sequence attention loop (dense)."""
    live = {"live": t}
    if spec.is_moe:
        _set_experts(t, "loop")
        try:
            record("live_loop_experts", seq, _steps(live, batch, args.steps)["live"], batch.num_tokens)
        finally:
            _set_experts(t, "auto")
        return
    with _unfused_head():
        record("live_unfused_head", seq, _steps(live, batch, args.steps)["live"], batch.num_tokens)
    if flash_varlen.ENABLED:
        flash_varlen.ENABLED = False
        try:
            record("live_loop_attention", seq, _steps(live, batch, args.steps)["live"], batch.num_tokens)
        finally:
            flash_varlen.ENABLED = True
    # 4k-token packs (where trainer.packed_attention = auto picks the mask): mask vs varlen
    small = argparse.Namespace(**{**vars(args), "micro_tokens": 4096})
    pair = {m: _trainer(spec, (False, m), "cpu" if args.smoke else "cuda", small) for m in ("masked", "varlen")}
    try:
        for m, dt in _steps(pair, batch, args.steps).items():
            record(f"live_4k_packs_{m}", seq, dt, batch.num_tokens)
    finally:
        for tr in pair.values():
            tr.close()


def _cuda_model(name: str, spec: ModelSpec, args: argparse.Namespace, peak: float,
                result: dict[str, float], rows: list[tuple]) -> None:
    dev = "cpu" if args.smoke else "cuda"
    eng = build_model(spec, seed=0, dtype=torch.bfloat16, device=dev)
    batches = {}
    for seq in args.seqs:
        groups = max(1, args.step_tokens // (args.group_size * seq))
        batches[seq] = _device_batch(eng, groups, args.group_size, seq)
    del eng
    _empty_cache()
    modes = {"live": False, "r3": True} if spec.is_moe else {"live": False}
    trainers = {tag: _trainer(spec, (replay, "auto"), dev, args) for tag, replay in modes.items()}
    if args.before:
        trainers["r3_before" if spec.is_moe else "live_before"] = _trainer(
            spec, (spec.is_moe, "auto"), dev, args, before=True)

    def record(tag: str, seq: int, dt: float, n: int) -> None:
        batch = batches[seq]
        frac = sum(s.response_ids.size for s in batch.samples) / batch.num_tokens
        mfu = n * _flops_per_token_std(spec, seq, frac) / dt / (peak * 1e12)
        key = f"{name}_s{seq}_{tag}"
        rows.append((name, f"s{seq} {tag}", n / dt, dt, mfu))
        result[f"{key}_tokens_per_s"] = n / dt
        result[f"{key}_mfu"] = mfu
        result[f"{key}_mfu_head_all_tokens"] = n * _flops_per_token_std(spec, seq) / dt / (peak * 1e12)

    for seq, batch in batches.items():
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        host_cpu: dict[str, float] = {}
        times = _steps(trainers, batch, args.steps, host_cpu)
        if torch.cuda.is_available():
            result[f"{name}_s{seq}_peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        for tag, dt in times.items():
            record(tag, seq, dt, batch.num_tokens)
            result[f"{name}_s{seq}_{tag}_host_cpu_s"] = host_cpu[tag]
        if "r3" in times:
            result[f"{name}_s{seq}_r3_overhead"] = times["r3"] / times["live"] - 1.0
    first = args.seqs[0]
    if args.baseline:
        try:
            _baselines(spec, trainers["live"], batches[first], first, args, record)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the main numbers stand
            print(f"{name}: baseline failed: {exc!r}")
            _empty_cache()
    if args.profile:
        last = args.seqs[0]  # the shortest sequences: the lowest MFU
        try:
            _profile(trainers["r3" if spec.is_moe else "live"], batches[last], f"{name} s{last}", result)
        except Exception as exc:  # noqa: BLE001 - a profiler failure must not lose the numbers
            print(f"{name}: profile failed: {exc!r}")
    already = all(getattr(layer, "ops", None) is not None for layer in trainers["live"].policy.model.layers)
    if args.compile and not already:  # last: compiling changes the trainer's model for good
        trainers["live"].policy.compile_blocks()
        t0 = time.perf_counter()
        try:
            for seq, batch in batches.items():
                dt = _steps({"live": trainers["live"]}, batch, args.steps)["live"]
                record("live_compiled", seq, dt, batch.num_tokens)
                if seq == first:
                    result[f"{name}_compile_warmup_s"] = time.perf_counter() - t0 - dt * args.steps
        except Exception as exc:  # noqa: BLE001 - report and go on: the other numbers stand
            print(f"{name}: compiled blocks failed: {exc!r}")
            result[f"{name}_compile_failed"] = 1.0
    for t in trainers.values():
        t.close()
    del trainers
    _empty_cache()


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=None, help="timed steps per mode (cpu 8, cuda 3)")
    ap.add_argument("--groups", type=int, default=4, help="cpu: groups per batch")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64, help="cpu: tokens per sequence")
    ap.add_argument("--seqs", default="1024,2048,4096", help="cuda: tokens per sequence, one run each")
    ap.add_argument("--step-tokens", type=int, default=32768, help="cuda: tokens per optimizer step")
    ap.add_argument("--micro-tokens", type=int, default=None, help="cpu 512, cuda 16384")
    ap.add_argument("--models", default=",".join(CUDA_MODELS), help="cuda: which models")
    ap.add_argument("--baseline", action="store_true", help="cuda: also the unfused head / expert loop")
    ap.add_argument("--profile", action="store_true", help="cuda: a CUDA-time table of one step per model")
    ap.add_argument("--recompute", default="off", choices=["off", "mlp", "full"],
                    help="trainer.recompute for every trainer (activation checkpointing; peak memory is reported)")
    ap.add_argument("--before", action="store_true",
                    help="cuda: also a trainer at the previous defaults (no compile, single-tensor AdamW)")
    ap.add_argument("--compile", action="store_true",
                    help="cuda: then also with CausalLM.compile_blocks() (first length, live routing)")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="0 = measure a bf16 GEMM")
    ap.add_argument("--smoke", action="store_true",
                    help="run the --device cuda flow on the CPU with tiny models (a test of the script)")
    args = ap.parse_args()
    if args.smoke:
        args.device, args.peak_tflops = "cuda", args.peak_tflops or 1.0
    gpu = args.device == "cuda"
    args.steps = args.steps or (3 if gpu else 8)
    args.micro_tokens = args.micro_tokens or (16384 if gpu else 512)
    args.seqs = [int(x) for x in args.seqs.split(",")]
    result: dict[str, float] = {}
    rows: list[tuple] = []
    host = host_description()
    print(f"host: {host}")
    if args.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
        spec = _spec("qwen3_moe", vocab_size=512, hidden_size=128, num_hidden_layers=2)
        times, n = _compare(spec, args, ((False, "auto"), (True, "auto")))
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
        _checks(result, "cpu" if args.smoke else "cuda", small=args.smoke)
        models = SMOKE_MODELS if args.smoke else CUDA_MODELS
        for name in args.models.split(","):
            kw = dict(models[name])
            _cuda_model(name, _spec(str(kw.pop("arch")), **kw), args, peak, result, rows)
    print(f"{'model':<16}{'mode':<26}{'tokens/s':>12}{'step s':>10}{'MFU':>8}")
    for name, mode, tps, dt, *mfu in rows:
        print(f"{name:<16}{mode:<26}{tps:>12.1f}{dt:>10.3f}" + (f"{mfu[0]:>8.3f}" if mfu else ""))
    print(json.dumps({**result, "host": host}))


if __name__ == "__main__":
    main()
