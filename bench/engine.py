"""Benchmark: decode throughput of the torch engine vs transformers `generate`, same model and batch.

CPU (default): tiny dense and MoE configs. `--device cuda`: a ~0.5B dense config and a
small MoE config, random bf16 weights; the engine replays decode steps as CUDA graphs
(captured during the warm-up run). Both sides decode greedily exactly
`--new` tokens for `--batch` prompts of `--prompt` tokens (no early stop; on cuda the MoE
model decodes half as many). After one warm-up run each, HF and engine runs are
interleaved (order alternating) for `--repeats` rounds, fewer when the warm-up shows that
they would overrun `--budget-s` per model, so load from other processes hits both alike; the speedup is the
median of the per-round ratios, tokens/s the medians of each side. Last line: one JSON
object with `{cpu|gpu}_{dense|moe}_speedup_vs_hf` and the tokens/s behind them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from typing import Any

import torch
import transformers

from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.hf_io import save_model
from miles.models.presets import tiny_config
from miles.models.registry import build_model

CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "cpu": {
        "dense": tiny_config("qwen3", vocab_size=2048, hidden_size=128, intermediate_size=384,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
        "moe": tiny_config("qwen3_moe", vocab_size=2048, hidden_size=128, intermediate_size=384,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64),
    },
    "cuda": {  # Qwen2.5-0.5B-shaped dense; a small Qwen3-MoE
        "dense": tiny_config("qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                             num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                             head_dim=64, tie_word_embeddings=True, rope_theta=1e6),
        "moe": tiny_config("qwen3_moe", vocab_size=32000, hidden_size=1024, intermediate_size=3072,
                           num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                           head_dim=64, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256),
    },
}


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def interleaved(repeats: int, a: Any, b: Any, budget_s: float) -> tuple[list[float], list[float]]:
    """Warm both up, then `repeats` rounds of one timed run each, alternating which goes first
    (at least one round; fewer than `repeats` when the warm-up says they overrun the budget)."""
    warm = timed(a) + timed(b)
    if budget_s < float("inf"):
        repeats = max(1, min(repeats, int(budget_s / max(warm, 1e-9))))
    ta, tb = [], []
    for r in range(repeats):
        if r % 2 == 0:
            ta.append(timed(a))
            tb.append(timed(b))
        else:
            tb.append(timed(b))
            ta.append(timed(a))
    return ta, tb


def bench_one(
    cfg: dict[str, Any], device: str, dtype: torch.dtype, args: argparse.Namespace, new: int
) -> dict[str, float]:
    model = build_model(ModelSpec.from_hf(cfg), dtype=dtype, device=device, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg["vocab_size"], (args.batch, args.prompt), generator=g)
    with tempfile.TemporaryDirectory() as d:
        save_model(model, d)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(device).eval()

    def run_hf() -> None:
        with torch.no_grad():
            hf.generate(prompts.to(device), max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=0, eos_token_id=None)

    engine = TorchEngine(model, EngineConfig(device=device, max_batch_size=args.batch,
                                             max_seq_len=args.prompt + new + 8, kv_budget_tokens=0))
    loop = asyncio.new_event_loop()

    async def gen_all() -> None:
        sp = SamplingParams(temperature=0.0, max_new_tokens=new)
        await asyncio.gather(*(engine.generate(GenerateRequest(input_ids=p.tolist(), sampling=sp))
                               for p in prompts))

    def run_engine() -> None:
        loop.run_until_complete(gen_all())

    t_hf, t_en = interleaved(args.repeats, run_hf, run_engine, args.budget_s)
    loop.run_until_complete(engine.close())
    loop.close()
    n = args.batch * new
    return {
        "hf_tok_s": n / statistics.median(t_hf),
        "engine_tok_s": n / statistics.median(t_en),
        "speedup": statistics.median(h / e for h, e in zip(t_hf, t_en, strict=True)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=None)
    ap.add_argument("--new", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for both sides")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="timed rounds per model stop at about this many seconds (cpu: no limit; cuda: 35)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # the CPU box is shared; more threads only add noise
    gpu = args.device == "cuda"
    args.batch = args.batch or (32 if gpu else 8)
    args.prompt = args.prompt or (128 if gpu else 32)
    args.new = args.new or (128 if gpu else 64)
    args.budget_s = args.budget_s or (35.0 if gpu else float("inf"))
    dtype = torch.bfloat16 if gpu else torch.float32
    prefix = "gpu" if gpu else "cpu"
    out: dict[str, Any] = {"device": args.device, "batch": args.batch, "prompt": args.prompt, "new": args.new}
    print(f"{'model':<8}{'hf tok/s':>12}{'engine tok/s':>15}{'speedup':>10}")
    for kind, cfg in CONFIGS[args.device].items():
        # HF's MoE generate loops over experts with host syncs every step: keep it in budget
        new = args.new // 2 if gpu and kind == "moe" else args.new
        r = bench_one(cfg, args.device, dtype, args, new)
        print(f"{kind:<8}{r['hf_tok_s']:>12.1f}{r['engine_tok_s']:>15.1f}{r['speedup']:>9.2f}x")
        out[f"{prefix}_{kind}_speedup_vs_hf"] = round(r["speedup"], 3)
        out[f"{prefix}_{kind}_engine_tok_s"] = round(r["engine_tok_s"], 1)
        out[f"{prefix}_{kind}_hf_tok_s"] = round(r["hf_tok_s"], 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
