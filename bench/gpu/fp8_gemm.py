"""Benchmark: the FP8 contract on the engine's linear layers (docs/fp8.md).

1. Quantizer exactness: every quantized weight of the quick-start model (and of the GEMM
   configs below) quantized on the CPU and on the device; differing bytes of codes, scales
   and Ŵ (bf16 and fp32) are counted (goal: 0). Without a GPU the second side is a fresh
   subprocess on the CPU (the trainer/engine process split).
2. GEMM: `project` (per-token 1x128 activation quantization + blockwise `scaled_mm`) vs the
   bf16 `F.linear` on the q|k|v, o, gate|up and down shapes of Qwen3-shaped layers with hidden
   1024 and 2048, at decode batch `--batch` (256). Kernels are timed inside a CUDA graph (as the
   engine replays decode steps), medians of `--repeats` rounds; "mm-only" is the scaled_mm alone
   (activations quantized beforehand). Goal: >= 1.5x bf16. On the CPU the FP8 side is the
   dequantize path (correctness only; no speed claim).
3. End to end: engine decode tokens/s with and without `model.fp8` (same model, same prompts,
   greedy, rounds interleaved), and the FP8 weight-sync bytes per version vs bf16 for the bench
   model and Qwen3-1.7B/8B shapes (goal: <= 0.55x; unquantized embeddings raise it).
4. Logprob gap: |trainer - engine| logprobs of sampled tokens, plain vs under the contract with
   the engine on FP8 GEMMs (activations rounded) or on dequantized weights (`engine.fp8_gemm`).

Last line: one JSON object. `--out FILE` also writes it there.
Run: python bench/gpu/fp8_gemm.py [--device cuda] [--out bench/results/fp8_gemm_h200.json]
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
from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.models.fp8 import FP8, SCALE_SUFFIX, dequantize_blockwise, quantize_blockwise
from miles.models.fp8_layout import Fp8Plan, quantize_rows, with_fp8
from miles.models.fp8_linear import (
    _HAS_SCALED_MM,
    _gemm_broken,
    blockwise_mm,
    fp8_hf_names,
    project,
    quantize_activations,
)
from miles.models.hf_io import hf_tensor_views
from miles.models.presets import tiny_config
from miles.models.registry import build_model

BLOCK = (128, 128)
LAYERS = {  # Qwen3-0.6B- and 1.7B-shaped decoder layers: hidden, heads, kv heads, head_dim, intermediate
    "h1024": (1024, 16, 8, 128, 3072),
    "h2048": (2048, 16, 8, 128, 6144),
}
REAL = {  # for sync bytes: Qwen3-1.7B and Qwen3-8B shapes (vocab 151936)
    "qwen3_1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3_8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
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


@torch.no_grad()
def gemm(device: str, batch: int, reps: int) -> list[dict[str, Any]]:
    rows = []
    dt = torch.bfloat16 if device != "cpu" else torch.float32
    g = torch.Generator().manual_seed(0)
    for tag, (h, nh, nkv, hd, inter) in LAYERS.items():
        if device == "cpu" and tag != "h1024":
            continue
        shapes = {"qkv": ((nh + 2 * nkv) * hd, h, (nh * hd, nkv * hd, nkv * hd)), "o": (h, nh * hd, (h,)),
                  "gate_up": (2 * inter, h, (inter, inter)), "down": (h, inter, (h,))}
        tot_bf, tot_f8 = 0.0, 0.0
        for name, (n, k, segs) in shapes.items():
            lin = nn.Linear(k, n, bias=False)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(n, k, generator=g) * 0.02)
            lin = lin.to(device=device, dtype=dt)
            x = (torch.randn(batch, k, generator=g)).to(device=device, dtype=dt)
            ref = F.linear(x, lin.weight)
            f8 = nn.Linear(k, n, bias=False).to(device=device, dtype=dt)
            with torch.no_grad():
                f8.weight.copy_(lin.weight)
            _to_fp8(f8, Fp8Plan(BLOCK, segs))
            y = project(x, f8)
            rel = float((y.float() - ref.float()).norm() / ref.float().norm())
            t_bf = _time_graph(lambda x=x, lin=lin: F.linear(x, lin.weight), device, reps)
            t_f8 = _time_graph(lambda x=x, f8=f8: project(x, f8), device, reps)
            t_mm = 0.0
            if device != "cpu" and not _gemm_broken and _HAS_SCALED_MM:  # the GEMM alone, activations quantized beforehand
                xq, xs = quantize_activations(x)
                xs = xs.t().contiguous().t()
                ws = F.pad(f8.weight_scale_inv.float(), (0, (-f8.weight_scale_inv.shape[1]) % 4)).t()
                t_mm = _time_graph(lambda xq=xq, xs=xs, ws=ws, f8=f8: blockwise_mm(xq, xs, f8.weight, ws, dt),
                                   device, reps)
            tot_bf += t_bf
            tot_f8 += t_f8
            rows.append({"layer": tag, "proj": name, "M": batch, "N": n, "K": k, "base_us": t_bf * 1e6,
                         "fp8_us": t_f8 * 1e6, "speedup": t_bf / t_f8, "gemm_only_us": t_mm * 1e6,
                         "rel_err": rel})
        rows.append({"layer": tag, "proj": "all4", "M": batch, "N": 0, "K": 0, "base_us": tot_bf * 1e6,
                     "fp8_us": tot_f8 * 1e6, "speedup": tot_bf / tot_f8,
                     "gemm_only_us": sum(r["gemm_only_us"] for r in rows if r["layer"] == tag), "rel_err": 0.0})
    return rows


@torch.no_grad()
def _to_fp8(lin: nn.Linear, plan: Fp8Plan) -> None:
    """One bench linear converted as `to_fp8_weights` converts the engine's layers."""
    codes, scale = quantize_rows(lin.weight.data, plan)
    lin.fp8_plan = plan  # type: ignore[assignment]
    lin.weight = nn.Parameter(codes, requires_grad=False)
    lin.register_parameter("weight" + SCALE_SUFFIX, nn.Parameter(scale, requires_grad=False))
    assert lin.weight.dtype == FP8


def engine_tok_s(cfg: dict[str, Any], device: str, batch: int, new: int, repeats: int) -> dict[str, float]:
    dt = torch.bfloat16 if device != "cpu" else torch.float32
    spec = ModelSpec.from_hf(cfg)
    prompts = torch.randint(0, cfg["vocab_size"], (batch, 16), generator=torch.Generator().manual_seed(0))
    loop = asyncio.new_event_loop()
    engines = {}
    for name, s in (("bf16", spec), ("fp8", with_fp8(spec, BLOCK))):
        engines[name] = TorchEngine(build_model(s, dtype=dt, device=device, seed=0),
                                    EngineConfig(device=device, max_batch_size=batch, max_seq_len=16 + new + 8,
                                                 kv_budget_tokens=0))

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
        run(e)  # warm-up (CUDA graph capture)
    ts: dict[str, list[float]] = {"bf16": [], "fp8": []}
    for r in range(repeats):
        for name in (("bf16", "fp8") if r % 2 == 0 else ("fp8", "bf16")):
            ts[name].append(run(engines[name]))
    for e in engines.values():
        loop.run_until_complete(e.close())
    loop.close()
    n = batch * new
    return {"base_tok_s": n / statistics.median(ts["bf16"]), "fp8_tok_s": n / statistics.median(ts["fp8"]),
            "ratio": statistics.median(b / f for b, f in zip(ts["bf16"], ts["fp8"], strict=True))}


def logprob_gap(cfg: dict[str, Any], device: str, prompts: int = 16, new: int = 32) -> dict[str, dict[str, float]]:
    """|trainer logprob - engine logprob| over sampled tokens: plain bf16, and under the FP8
    contract with the engine on FP8 GEMMs or on dequantized weights (`engine.fp8_gemm`)."""
    from miles.models.logprobs import token_logprobs

    dt = torch.bfloat16 if device != "cpu" else torch.float32
    spec = ModelSpec.from_hf(cfg)
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(0, cfg["vocab_size"], (16,), generator=g).tolist() for _ in range(prompts)]
    out: dict[str, dict[str, float]] = {}
    loop = asyncio.new_event_loop()
    for name, s, fp8_gemm in (("base", spec, True), ("fp8_gemm", with_fp8(spec, BLOCK), True),
                              ("fp8_dequant", with_fp8(spec, BLOCK), False)):
        engine = TorchEngine(build_model(s, dtype=dt, device=device, seed=0),
                             EngineConfig(device=device, max_batch_size=prompts, max_seq_len=16 + new + 8,
                                          fp8_gemm=fp8_gemm))
        trainer = build_model(s, dtype=dt, device=device, seed=0)

        async def go(engine: TorchEngine = engine) -> list[Any]:
            return list(await asyncio.gather(*(engine.generate(GenerateRequest(
                input_ids=p, sampling=SamplingParams(temperature=1.0, max_new_tokens=new, seed=i)))
                for i, p in enumerate(ps))))

        res = loop.run_until_complete(go())
        diffs = []
        with torch.no_grad():
            for p, r in zip(ps, res, strict=True):
                ids = torch.tensor([p + r.output_ids[:-1]], device=device)
                lg = trainer(ids).logits[0, len(p) - 1:].float()
                lp = token_logprobs(lg, torch.tensor(r.output_ids, device=device), 1.0).cpu()
                diffs.append((lp - torch.tensor(r.logprobs)).abs())
        d = torch.cat(diffs)
        out[name] = {"mean": float(d.mean()), "max": float(d.max()), "tokens": int(d.numel())}
        loop.run_until_complete(engine.close())
    loop.close()
    return out


def sync_bytes(cfg: dict[str, Any]) -> dict[str, float]:
    """Bytes of one FP8 version (codes 1 B + fp32 scales; the rest bf16) vs all-bf16, from shapes."""
    spec = with_fp8(ModelSpec.from_hf(cfg), BLOCK)
    names = fp8_hf_names(spec)
    with torch.device("meta"):
        model = CausalLM(spec)
    bf16 = fp8 = 0
    for n, t in hf_tensor_views(model).items():
        bf16 += t.numel() * 2
        if n in names:
            r, c = t.shape
            fp8 += t.numel() + (-(-r // BLOCK[0])) * (-(-c // BLOCK[1])) * 4
        else:
            fp8 += t.numel() * 2
    return {"fp8_bytes": fp8, "bf16_bytes": bf16, "ratio": fp8 / bf16}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=0, help="0: 50 on cuda, 5 on cpu")
    ap.add_argument("--new", type=int, default=0, help="decode tokens per request end to end; 0: 128 cuda, 8 cpu")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    cuda = a.device != "cpu"
    reps = a.repeats or (50 if cuda else 5)
    batch = a.batch if cuda else min(a.batch, 32)
    new = a.new or (128 if cuda else 8)
    quick = tiny_config("qwen3_moe", vocab_size=2048)  # the quick-start model (examples/quickstart*.toml)
    e2e_cfg = (tiny_config("qwen3", vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128) if cuda else
               tiny_config("qwen3", vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64))
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    res["exactness"] = exactness(a.device, {"quickstart_qwen3_moe": quick, "e2e": e2e_cfg})
    print("quantizer exactness:", json.dumps(res["exactness"]))
    rows = gemm(a.device, batch, reps)
    res["fp8_gemm_path"] = ("dequantized fallback: " + _gemm_broken[0]) if _gemm_broken else (
        "dequantized (cpu)" if not cuda else "scaled_mm blockwise" if _HAS_SCALED_MM
        else "dequantized (this torch has no F.scaled_mm)")
    base = "bf16" if cuda else "fp32"
    res["base_dtype"] = base
    print(f"{'layer':6} {'proj':8} {'M':>4} {'N':>6} {'K':>5} {base + ' us':>9} {'fp8 us':>9} {'speedup':>8} "
          f"{'mm-only us':>10} {'rel err':>8}")
    for r in rows:
        print(f"{r['layer']:6} {r['proj']:8} {r['M']:>4} {r['N']:>6} {r['K']:>5} {r['base_us']:>9.1f} "
              f"{r['fp8_us']:>9.1f} {r['speedup']:>8.2f} {r['gemm_only_us']:>10.1f} {r['rel_err']:>8.4f}")
    res["gemm"] = rows
    res["gemm_speedup_all4"] = {r["layer"]: r["speedup"] for r in rows if r["proj"] == "all4"}
    print("fp8 GEMM path:", res["fp8_gemm_path"])
    res["engine"] = engine_tok_s(e2e_cfg, a.device, batch, new, max(3, reps // 10))
    print(f"engine decode (batch {batch}, {new} tokens): {base} {res['engine']['base_tok_s']:.0f} tok/s, "
          f"fp8 {res['engine']['fp8_tok_s']:.0f} tok/s, ratio {res['engine']['ratio']:.2f}")
    res["logprob_gap"] = logprob_gap(e2e_cfg, a.device)
    for k, v in res["logprob_gap"].items():
        print(f"|logp trainer - engine| {k:12}: mean {v['mean']:.2e}, max {v['max']:.2e} over {v['tokens']} tokens")
    res["sync_bytes"] = {"e2e": sync_bytes(e2e_cfg),
                         **{k: sync_bytes(tiny_config("qwen3", vocab_size=151936, **v)) for k, v in REAL.items()}}
    for k, v in res["sync_bytes"].items():
        print(f"sync bytes {k}: fp8 {v['fp8_bytes'] / 2**20:.1f} MiB vs bf16 {v['bf16_bytes'] / 2**20:.1f} MiB "
              f"= {v['ratio']:.3f}x")
    line = json.dumps(res)
    if a.out:
        with open(a.out, "w") as f:
            f.write(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
