"""Benchmark: the FP8 contract on the engine's linear layers (docs/fp8.md).

1. Quantizer exactness: every quantized weight of the quick-start model (and of the engine
   config below) quantized on the CPU and on the device; differing bytes of codes, scales
   and Ŵ (bf16 and fp32) are counted (goal: 0). Without a GPU the second side is a fresh
   subprocess on the CPU (the trainer/engine process split).
2. GEMM, per projection of Qwen3-shaped layers (hidden 1024, 2048, 4096) at each `--batches`
   size (decode batch 256 is the goal's; smaller ones are memory-bound context), timed inside a
   CUDA graph (as the engine replays decode steps), medians of `--repeats` replays, us per call:
   bf16 `F.linear`; the Triton kernels `triton_a8` (activation quantization fused, FP8 tensor
   cores) and `triton_a16` (Ŵ rebuilt in registers, bf16 tensor cores); `cublas_a8` (a one-kernel
   activation quantization + `F.scaled_mm` blockwise) with its two parts alone (`quant`, `mm`);
   `dequant` (Ŵ materialised + `F.linear`); `ideal_*`: datasheet lower bounds (bytes / 4.8 TB/s,
   FLOPs / dense peak; no launch cost). Goal: FP8 >= 1.5x bf16 at batch 256. On the CPU only
   the dequantized path runs (correctness, no speed claim).
3. End to end: engine decode tokens/s, bf16 vs `model.fp8` with `engine.fp8_gemm` true
   (triton_a8) and false (triton_a16); same model and prompts, greedy, rounds interleaved.
4. Sync bytes per version vs bf16, whole model and the quantized tensors alone, for the bench
   model and Qwen3-1.7B/8B/32B shapes (goal <= 0.55x; the bf16 embeddings / LM head raise it).

The train/rollout logprob gap is bench/gpu/fp8_logprob_gap.py.
Last line: one JSON object. `--out FILE` also writes it there.
Run: python bench/gpu/fp8_gemm.py [--device cuda] [--parts exactness,gemm,engine,sync] [--out F.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import xxhash
from torch import nn

from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.torch_engine import TorchEngine
from miles.models import fp8_gemm
from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.models.fp8 import FP8, SCALE_SUFFIX, dequantize_blockwise, quantize_blockwise
from miles.models.fp8_layout import Fp8Plan, quantize_rows, with_fp8
from miles.models.fp8_model import fp8_hf_names
from miles.models.hf_io import hf_tensor_views
from miles.models.presets import tiny_config
from miles.models.registry import build_model

BLOCK = (128, 128)
LAYERS = {  # Qwen3-0.6B-, 1.7B- and 8B-shaped decoder layers: hidden, heads, kv heads, head_dim, intermediate
    "h1024": (1024, 16, 8, 128, 3072),
    "h2048": (2048, 16, 8, 128, 6144),
    "h4096": (4096, 32, 8, 128, 12288),
}
REAL = {  # for sync bytes: Qwen3-1.7B, 8B and 32B shapes (vocab 151936)
    "qwen3_1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3_8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "qwen3_32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}


def _digest(c: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> tuple[bytes, bytes, bytes]:
    w = dequantize_blockwise(c, s, BLOCK, dtype).cpu()
    return c.cpu().view(torch.uint8).numpy().tobytes(), s.cpu().numpy().tobytes(), w.view(torch.uint8).numpy().tobytes()


def _weights(spec: ModelSpec, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    model = build_model(with_fp8(spec, BLOCK), dtype=dtype, seed=0)
    names = fp8_hf_names(with_fp8(spec, BLOCK))
    return [(n, t) for n, t in hf_tensor_views(model).items() if n in names]


_CHILD = """
import sys, torch, xxhash
from miles.models.config import ModelSpec
sys.path.insert(0, "bench/gpu")
from fp8_gemm import _weights, _digest, BLOCK
from miles.models.fp8 import quantize_blockwise
spec = ModelSpec.from_hf(__import__("json").loads(sys.argv[1]))
for dt in (torch.float32, torch.bfloat16):
    for n, w in _weights(spec, dt):
        c, s = quantize_blockwise(w, BLOCK)
        print(n, dt, *[xxhash.xxh64(b).hexdigest() for b in _digest(c, s, dt)])
"""


def _differing(p: bytes, q: bytes) -> int:
    """Differing bytes of two digests' raw bytes (vectorised: a 1B-parameter model is GBs)."""
    if len(p) != len(q):
        return max(len(p), len(q))
    return int((np.frombuffer(p, np.uint8) != np.frombuffer(q, np.uint8)).sum())


def exactness(device: str, specs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, cfg in specs.items():
        spec = ModelSpec.from_hf(cfg)
        tensors = diff = 0
        if device == "cpu":  # the other side: a fresh process
            res = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cfg)], capture_output=True,
                                 text=True, check=True, timeout=600)
            theirs = res.stdout.split("\n")
        mine = []
        for dt in (torch.float32, torch.bfloat16):
            for n, w in _weights(spec, dt):
                c, s = quantize_blockwise(w, BLOCK)
                a = _digest(c, s, dt)
                if device == "cpu":
                    mine.append(" ".join([n, str(dt), *[xxhash.xxh64(b).hexdigest() for b in a]]))
                else:
                    cg, sg = quantize_blockwise(w.to(device), BLOCK)
                    b = _digest(cg, sg, dt)
                    diff += sum(_differing(p, q) for p, q in zip(a, b, strict=True))
                tensors += 1
        if device == "cpu":
            diff = sum(x != y for x, y in zip(mine, theirs, strict=False)) + abs(len(mine) - len([t for t in theirs if t]))
            out[name] = {"tensors": tensors, "differing_lines": diff, "vs": "cpu subprocess"}
        else:
            out[name] = {"tensors": tensors, "differing_bytes": diff, "vs": f"cpu vs {device}"}
    return out


def _time_graph(fn: Any, device: str, reps: int, inner: int = 20) -> float:
    """Seconds per call: `inner` calls captured in one CUDA graph, median over `reps` replays."""
    if device == "cpu":
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3 / inner)
    return statistics.median(ts)


KERNELS = ("triton_a8", "triton_a16", "cublas_a8")


def _shapes(h: int, nh: int, nkv: int, hd: int, inter: int) -> dict[str, tuple[int, int, tuple[int, ...]]]:
    return {"qkv": ((nh + 2 * nkv) * hd, h, (nh * hd, nkv * hd, nkv * hd)), "o": (h, nh * hd, (h,)),
            "gate_up": (2 * inter, h, (inter, inter)), "down": (h, inter, (h,))}


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


@torch.no_grad()
def gemm(device: str, batches: list[int], reps: int, layers: list[str]) -> list[dict[str, Any]]:
    """One row per (layer, projection, batch) plus an `all4` row per (layer, batch): us per call."""
    rows: list[dict[str, Any]] = []
    cuda = device != "cpu"
    dt = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator().manual_seed(0)
    for tag in layers:
        for name, (n, k, segs) in _shapes(*LAYERS[tag]).items():
            w = (torch.randn(n, k, generator=g) * 0.02).to(device=device, dtype=dt)
            f8 = nn.Linear(k, n, bias=False).to(device=device, dtype=dt)
            f8.weight.copy_(w)
            _to_fp8(f8, Fp8Plan(BLOCK, segs))
            codes, scale = f8.weight, f8.weight_scale_inv
            w_hat = dequantize_blockwise(codes, scale, BLOCK, dt)
            for m in batches:
                x = torch.randn(m, k, generator=g).to(device=device, dtype=dt)
                row: dict[str, Any] = {"layer": tag, "proj": name, "M": m, "N": n, "K": k}
                row.update(_ideal_us(m, n, k))
                row["base_us"] = _time_graph(lambda x=x, w=w: F.linear(x, w), device, reps) * 1e6
                row["dequant_us"] = _time_graph(
                    lambda x=x, c=codes, s=scale: F.linear(x, dequantize_blockwise(c, s, BLOCK, dt)), device, reps) * 1e6
                ref = F.linear(x.float(), w_hat.float())
                row["rel_err"] = {"dequant": _rel(F.linear(x, w_hat), ref)}
                for kind in KERNELS if cuda else ():
                    if not fp8_gemm.usable(kind):
                        continue
                    try:
                        row["rel_err"][kind] = _rel(fp8_gemm.run(kind, x, codes, scale, None), ref)
                        row[kind + "_us"] = _time_graph(
                            lambda x=x, kind=kind, c=codes, s=scale: fp8_gemm.run(kind, x, c, s, None),
                            device, reps) * 1e6
                    except Exception as exc:  # noqa: BLE001 - report which kernel this GPU/torch lacks
                        fp8_gemm.broken[kind] = f"{type(exc).__name__}: {exc}"
                if cuda and fp8_gemm.usable("cublas_a8"):  # its two halves alone
                    xq, xs = fp8_gemm.quantize_activations(x)
                    xs, ws = fp8_gemm.outer_major(xs), fp8_gemm.cublas_weight_scales(scale)
                    row["quant_us"] = _time_graph(lambda x=x: fp8_gemm.cublas_act_quant(x), device, reps) * 1e6
                    row["mm_us"] = _time_graph(
                        lambda xq=xq, xs=xs, ws=ws, c=codes: fp8_gemm.blockwise_mm(xq, xs, c, ws, dt), device, reps) * 1e6
                _speedups(row)
                rows.append(row)
                _print_row(row)
    for tag in layers:
        for m in batches:
            part = [r for r in rows if r["layer"] == tag and r["M"] == m]
            tot = {key: sum(r[key] for r in part) for key in part[0] if key.endswith("_us")
                   and all(key in r for r in part)}
            row = {"layer": tag, "proj": "all4", "M": m, "N": 0, "K": 0, **tot}
            _speedups(row)
            rows.append(row)
            _print_row(row)
    return rows


# H200 SXM datasheet peaks (dense): HBM3e 4.8 TB/s, bf16 989 TFLOP/s, FP8 1979 TFLOP/s
_HBM, _BF16_FLOPS, _FP8_FLOPS = 4.8e12, 989e12, 1979e12


def _ideal_us(m: int, n: int, k: int) -> dict[str, float]:
    """Lower bounds from the datasheet: max(bytes moved / bandwidth, FLOPs / peak), launch ignored."""
    flops = 2 * m * n * k
    bf16 = max((2 * n * k + 2 * m * k + 2 * m * n) / _HBM, flops / _BF16_FLOPS)
    fp8 = max((n * k + 4 * (n // 128) * (k // 128) + 2 * m * k + 2 * m * n) / _HBM, flops / _FP8_FLOPS)
    return {"ideal_bf16_us": bf16 * 1e6, "ideal_fp8_us": fp8 * 1e6}


def _speedups(r: dict[str, Any]) -> None:
    r["speedup"] = {key[:-3]: r["base_us"] / r[key] for key in r
                    if key.endswith("_us") and key != "base_us" and not key.startswith("ideal")}


_COLS = ["base", "triton_a8", "triton_a16", "cublas_a8", "quant", "mm", "dequant", "ideal_bf16", "ideal_fp8"]


def _print_header(base: str) -> None:
    print(f"{'layer':6} {'proj':8} {'M':>4} {'N':>6} {'K':>5} " + " ".join(
        f"{(base if c == 'base' else c) + ' us':>13}" for c in _COLS) + "   speedup a8/a16/cublas", flush=True)


def _print_row(r: dict[str, Any]) -> None:
    sp = r["speedup"]
    print(f"{r['layer']:6} {r['proj']:8} {r['M']:>4} {r['N']:>6} {r['K']:>5} " + " ".join(
        f"{r.get(c + '_us', float('nan')):>13.1f}" for c in _COLS)
        + "   " + "/".join(f"{sp.get(c, float('nan')):.2f}" for c in ("triton_a8", "triton_a16", "cublas_a8")),
        flush=True)


@torch.no_grad()
def _to_fp8(lin: nn.Linear, plan: Fp8Plan) -> None:
    """One bench linear converted as `to_fp8_weights` converts the engine's layers."""
    codes, scale = quantize_rows(lin.weight.data, plan)
    lin.fp8_plan = plan  # type: ignore[assignment]
    lin.weight = nn.Parameter(codes, requires_grad=False)
    lin.register_parameter("weight" + SCALE_SUFFIX, nn.Parameter(scale, requires_grad=False))
    assert lin.weight.dtype == FP8


def engine_tok_s(cfg: dict[str, Any], device: str, batch: int, new: int, repeats: int) -> dict[str, Any]:
    """Decode tokens/s of the same model: bf16, FP8 with activations rounded (fp8_gemm true),
    FP8 with exact activations (fp8_gemm false); rounds interleaved, medians."""
    dt = torch.bfloat16 if device != "cpu" else torch.float32
    spec = ModelSpec.from_hf(cfg)
    prompts = torch.randint(0, cfg["vocab_size"], (batch, 16), generator=torch.Generator().manual_seed(0))
    loop = asyncio.new_event_loop()
    variants = {"base": (spec, True), "fp8_a8": (with_fp8(spec, BLOCK), True), "fp8_a16": (with_fp8(spec, BLOCK), False)}
    state = build_model(spec, dtype=dt, seed=0).state_dict()  # one random init for the three

    def model(s: ModelSpec) -> CausalLM:
        m = build_model(s, dtype=dt)
        m.load_state_dict(state)
        return m.to(device)

    engines = {name: TorchEngine(model(s), EngineConfig(device=device, max_batch_size=batch, max_seq_len=16 + new + 8,
                                                        kv_budget_tokens=0, fp8_gemm=gemm_on))
               for name, (s, gemm_on) in variants.items()}

    def run(eng: TorchEngine) -> float:
        sp = SamplingParams(temperature=0.0, max_new_tokens=new)

        async def go() -> None:
            await asyncio.gather(*(eng.generate(GenerateRequest(input_ids=p.tolist(), sampling=sp))
                                   for p in prompts))

        t0 = time.perf_counter()
        loop.run_until_complete(go())
        if device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for e in engines.values():
        run(e)  # warm-up (CUDA graph capture, kernel tuning)
    ts: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(repeats):
        for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            ts[name].append(run(engines[name]))
    for e in engines.values():
        loop.run_until_complete(e.close())
    loop.close()
    n = batch * new
    out: dict[str, Any] = {f"{k}_tok_s": n / statistics.median(v) for k, v in ts.items()}
    for k in ("fp8_a8", "fp8_a16"):
        out[f"ratio_{k}"] = statistics.median(b / f for b, f in zip(ts["base"], ts[k], strict=True))
    out["kernels_refused"] = dict(fp8_gemm.broken)
    # the engine's per-shape choice (us per kernel, per (act_fp8, M bucket, N, K)), timed on first use
    out["kernel_pick"] = {str(k): v for k, v in fp8_gemm.timings.items()}
    return out


def sync_bytes(cfg: dict[str, Any]) -> dict[str, float]:
    """Bytes of one FP8 version (codes 1 B + fp32 scales; the rest bf16) vs all-bf16, from shapes:
    the whole model and the quantized tensors alone."""
    spec = with_fp8(ModelSpec.from_hf(cfg), BLOCK)
    names = fp8_hf_names(spec)
    with torch.device("meta"):
        model = CausalLM(spec)
    bf16 = fp8 = q_bf16 = q_fp8 = 0
    for n, t in hf_tensor_views(model).items():
        bf16 += t.numel() * 2
        if n in names:
            r, c = t.shape
            q = t.numel() + (-(-r // BLOCK[0])) * (-(-c // BLOCK[1])) * 4
            fp8, q_bf16, q_fp8 = fp8 + q, q_bf16 + t.numel() * 2, q_fp8 + q
        else:
            fp8 += t.numel() * 2
    return {"fp8_bytes": fp8, "bf16_bytes": bf16, "ratio": fp8 / bf16, "quantized_ratio": q_fp8 / q_bf16,
            "quantized_share_of_bf16": q_bf16 / bf16}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--parts", default="exactness,gemm,engine,sync")
    ap.add_argument("--batches", default="", help="GEMM batch sizes, comma-separated; default 16,256 cuda, 32 cpu")
    ap.add_argument("--layers", default="", help="h1024,h2048,h4096 on cuda; h1024 on cpu")
    ap.add_argument("--batch", type=int, default=256, help="engine decode batch")
    ap.add_argument("--repeats", type=int, default=0, help="0: 50 on cuda, 5 on cpu")
    ap.add_argument("--new", type=int, default=0, help="decode tokens per request end to end; 0: 128 cuda, 8 cpu")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    cuda = a.device != "cpu"
    parts = set(a.parts.split(","))
    reps = a.repeats or (50 if cuda else 5)
    batch = a.batch if cuda else min(a.batch, 32)
    batches = [int(b) for b in (a.batches or ("16,256" if cuda else "32")).split(",")]
    layers = (a.layers or ("h1024,h2048,h4096" if cuda else "h1024")).split(",")
    new = a.new or (128 if cuda else 8)
    quick = tiny_config("qwen3_moe", vocab_size=2048)  # the quick-start model (examples/quickstart*.toml)
    e2e_cfg = (tiny_config("qwen3", vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128) if cuda else
               tiny_config("qwen3", vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64))
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    base = "bf16" if cuda else "fp32"
    res["base_dtype"] = base
    if "exactness" in parts:
        res["exactness"] = exactness(a.device, {"quickstart_qwen3_moe": quick, "e2e": e2e_cfg})
        print("quantizer exactness:", json.dumps(res["exactness"]), flush=True)
    if "gemm" in parts:
        _print_header(base)
        rows = gemm(a.device, batches, reps, layers)
        res["gemm"] = rows
        res["gemm_speedup_all4"] = {f"{r['layer']}_M{r['M']}": r["speedup"] for r in rows if r["proj"] == "all4"}
        res["kernels_refused"] = dict(fp8_gemm.broken)
        print("kernels refused:", res["kernels_refused"] or "none", flush=True)
        if cuda and fp8_gemm.has_triton():  # the Triton tuner's candidates (us), per (a8, M bucket, N, K)
            from miles.models import fp8_triton

            res["triton_tiles"] = {str(k): v for k, v in fp8_triton.timings.items()}
    if "engine" in parts:
        e = res["engine"] = engine_tok_s(e2e_cfg, a.device, batch, new, max(3, reps // 10))
        print(f"engine decode (batch {batch}, {new} tokens): {base} {e['base_tok_s']:.0f} tok/s, "
              f"fp8_a8 {e['fp8_a8_tok_s']:.0f} ({e['ratio_fp8_a8']:.2f}x), "
              f"fp8_a16 {e['fp8_a16_tok_s']:.0f} ({e['ratio_fp8_a16']:.2f}x)", flush=True)
    if "sync" in parts:
        res["sync_bytes"] = {"e2e": sync_bytes(e2e_cfg),
                             **{k: sync_bytes(tiny_config("qwen3", vocab_size=151936, **v)) for k, v in REAL.items()}}
        for k, v in res["sync_bytes"].items():
            print(f"sync bytes {k}: fp8 {v['fp8_bytes'] / 2**20:.1f} MiB vs bf16 {v['bf16_bytes'] / 2**20:.1f} MiB "
                  f"= {v['ratio']:.3f}x whole model; {v['quantized_ratio']:.3f}x over the quantized tensors "
                  f"({v['quantized_share_of_bf16']:.0%} of the bf16 bytes)")
    line = json.dumps(res)
    if a.out:
        with open(a.out, "w") as f:
            f.write(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
