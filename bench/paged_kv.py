"""Benchmark: the torch engine's KV layouts, rows (default) vs paged (engine.kv_layout), same requests.

Per case and layout: tokens/s (generated tokens / wall time of the whole batch, prefill included;
median of `--repeats` timed runs after one warm-up, the layouts' runs alternating) and KV memory: what the pool allocates, and
for paged the most blocks in use at once (x block bytes). Layouts:

  rows        engine.kv_layout=rows: max_batch_size rows of max_seq_len
  paged       kv_layout=paged, pool of the rows layout's size (kv_pool_tokens=0)
  paged_fit   kv_layout=paged, pool sized to the case: batch x (prompt + new) tokens

On cuda every layout decodes through CUDA graphs (captured in the warm-up run); the paged pool
also gathers each layer's K/V through its block tables (one copy per layer and step).

Every request is greedy, no stop ids, runs to `new` tokens; a group case sends n samples of each
prompt (engine.share_prompts on: the paged pool shares the prompt's full blocks). Models: cpu a
tiny qwen3 (fp32), cuda a Qwen2.5-0.5B-shaped dense (bf16), random weights.
Last line: one JSON object (also written to `--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import torch
from engine_cases import (  # bench/ on sys.path
    CASES,
    MODELS,
    Case,
    check_results,
    prompts_for,
    requests_for,
    sampling_for,
)

from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest
from miles.engines.paged_kv import PagedPool
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.registry import build_model

# bench/engine.py's dense model and these of its cases (bench/engine_cases.py)
LAYOUT_CASES = {"cpu": ("b8", "group2x4"), "cuda": ("b32", "b128", "group8x8")}
MAX_SEQ = {"cpu": 512, "cuda": 2048}


def requests(case: Case, vocab: int) -> list[GenerateRequest]:
    ids = [p.tolist() for p in prompts_for(case, vocab)]
    return requests_for(ids, sampling_for(case))


async def run_once(eng: TorchEngine, case: Case, reqs: list[GenerateRequest]) -> float:
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = await asyncio.gather(*(eng.generate(r) for r in reqs))
    dt = time.perf_counter() - t0
    check_results(case, out, f"torch engine ({eng.cfg.kv_layout})")
    return dt


def memory(eng: TorchEngine) -> dict[str, float]:
    pool, bpt = eng.pool, eng.pool.bytes_per_token()
    if isinstance(pool, PagedPool):
        alloc, peak = (pool.num_blocks + 2) * pool.bs * bpt, pool.peak * pool.bs * bpt
    else:
        alloc = peak = pool.k[0].shape[0] * (pool.max_seq_len + 1) * bpt
    return {"kv_alloc_mib": round(alloc / 2**20, 2), "kv_peak_mib": round(peak / 2**20, 2)}


async def time_layouts(model: Any, cfgs: dict[str, EngineConfig], case: Case, reqs: list[GenerateRequest],
                       repeats: int) -> dict[str, dict[str, Any]]:
    """Every layout's engine warms up once (graph capture, allocator), then the timed runs
    alternate between the layouts, so load from other processes hits all of them alike."""
    engines = {k: TorchEngine(model, c) for k, c in cfgs.items()}
    try:
        for eng in engines.values():
            await run_once(eng, case, reqs)
        times: dict[str, list[float]] = {k: [] for k in engines}
        for _ in range(repeats):
            for k, eng in engines.items():
                times[k].append(await run_once(eng, case, reqs))
        tokens = sum(r.sampling.max_new_tokens for r in reqs)
        return {k: {"tok_s": round(tokens / statistics.median(times[k]), 1), **memory(eng)}
                for k, eng in engines.items()}
    finally:
        for eng in engines.values():
            await eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--cases", default="", help="comma list (default: every case of the device)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per layout after one warm-up (cpu 7, cuda 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--out", default="", help="also write the JSON object here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (3 if args.device == "cuda" else 7)
    dev, dtype = args.device, "bfloat16" if args.device == "cuda" else "float32"
    spec = ModelSpec.from_hf(MODELS[dev]["dense"])
    model = build_model(spec, seed=0).to(device=dev, dtype=getattr(torch, dtype))
    names = args.cases.split(",") if args.cases else LAYOUT_CASES[dev]
    cases = {k: CASES[dev][k] for k in names}
    result: dict[str, Any] = {"device": dev, "dtype": dtype, "max_seq_len": MAX_SEQ[dev]}
    print(f"{'case':10} {'layout':10} {'tok/s':>10} {'KV alloc MiB':>13} {'KV peak MiB':>12}")
    for name, case in cases.items():
        reqs = requests(case, spec.vocab_size)
        base = {"device": dev, "dtype": dtype, "max_batch_size": len(reqs), "max_seq_len": MAX_SEQ[dev]}
        layouts = {
            "rows": EngineConfig(**base),  # type: ignore[arg-type]
            "paged": EngineConfig(**base, kv_layout="paged"),  # type: ignore[arg-type]
            "paged_fit": EngineConfig(**base, kv_layout="paged",  # type: ignore[arg-type]
                                      kv_pool_tokens=len(reqs) * (case.prompt + case.new)),
        }
        for lay, r in asyncio.run(time_layouts(model, layouts, case, reqs, repeats)).items():
            result[f"{name}_{lay}"] = r
            print(f"{name:10} {lay:10} {r['tok_s']:>10} {r['kv_alloc_mib']:>13} {r['kv_peak_mib']:>12}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
