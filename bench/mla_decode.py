"""Benchmark: MLA (DeepSeek-V3 attention) in the torch engine, latent KV cache vs expanded K/V.

Two numbers per model shape:
- KV bytes per token: what `RowPool` allocates per token over all layers, for the MLA
  latent cache (kv_lora_rank + qk_rope_head_dim per layer) and for the same attention with
  K/V expanded per head (heads x (qk_head_dim + v_head_dim) per layer, the GQA-style cache
  an engine without latent caching would hold); the ratio is the goal (<= 0.3).
- decode tokens/s of the torch engine on the MLA model (random weights, greedy, exactly
  `--new` tokens for `--batch` prompts of `--prompt` tokens; CUDA graphs on cuda).

CPU (default): a tiny DeepSeek-V3 config. `--device cuda`: DeepSeek-V3's attention shapes
(hidden 7168, 128 heads, kv_lora_rank 512, q_lora_rank 1536, rope 64, nope 128, v 128) and
its router (8 groups, top-4 groups, top-8), cut to `--layers` layers, 32 experts of 2048
and a 32k vocab so the random model fits one GPU, bf16. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import torch

from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.kv_cache import RowPool
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model


def config(device: str, layers: int) -> dict[str, Any]:
    if device == "cpu":
        return tiny_config("deepseek_v3", vocab_size=2048, hidden_size=128, num_hidden_layers=layers,
                           num_attention_heads=8, kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32,
                           qk_rope_head_dim=16, v_head_dim=32, moe_intermediate_size=64, intermediate_size=256)
    return tiny_config(
        "deepseek_v3", vocab_size=32768, hidden_size=7168, intermediate_size=18432, num_hidden_layers=layers,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=32,
        num_experts_per_tok=8, n_group=8, topk_group=4, moe_intermediate_size=2048, first_k_dense_replace=1,
        initializer_range=0.006,
    )


def kv_bytes(spec: ModelSpec, dtype: torch.dtype) -> tuple[int, int]:
    pool = RowPool(spec, rows=1, max_seq_len=1, dtype=dtype, device=torch.device("cpu"))
    m = spec.mla
    assert m is not None
    expanded = spec.num_layers * spec.num_heads * (m.qk_head_dim + m.v_head_dim) * torch.finfo(dtype).bits // 8
    return pool.bytes_per_token(), expanded


async def decode_rate(spec: ModelSpec, device: str, dtype: torch.dtype, batch: int, prompt: int, new: int) -> float:
    model = build_model(spec, dtype=dtype, device=device, seed=0)
    eng = TorchEngine(model, EngineConfig(max_batch_size=batch, max_seq_len=prompt + new + 8,
                                          cuda_graphs=device == "cuda"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, spec.vocab_size, (prompt,), generator=g).tolist() for _ in range(batch)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new)
    try:
        for _rep in range(2):  # the first run warms up (and captures the CUDA graphs)
            t0 = time.perf_counter()
            res = await asyncio.gather(*(eng.generate(GenerateRequest(input_ids=p, sampling=sampling))
                                         for p in prompts))
            if device == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        assert all(len(r.output_ids) == new for r in res)
    finally:
        await eng.close()
    return batch * new / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    spec = ModelSpec.from_hf(config(args.device, args.layers))
    latent, expanded = kv_bytes(spec, dtype)
    rate = asyncio.run(decode_rate(spec, args.device, dtype, args.batch, args.prompt, args.new))
    m = spec.mla
    assert m is not None
    print(f"{'shape':44} {'KV B/token latent':>18} {'expanded':>10} {'ratio':>7} {'decode tok/s':>13}")
    shape = f"{spec.num_layers}L h{spec.hidden_size} {spec.num_heads}heads r{m.kv_lora_rank}+{m.qk_rope_head_dim}"
    print(f"{shape:44} {latent:>18} {expanded:>10} {latent / expanded:>7.4f} {rate:>13.1f}")
    print(json.dumps({
        "device": args.device, "dtype": str(dtype).removeprefix("torch."), "layers": spec.num_layers,
        "kv_bytes_per_token_latent": latent, "kv_bytes_per_token_expanded": expanded,
        "kv_ratio": round(latent / expanded, 5), "decode_tokens_per_s": round(rate, 1),
        "batch": args.batch, "prompt": args.prompt, "new": args.new,
    }))


if __name__ == "__main__":
    main()
