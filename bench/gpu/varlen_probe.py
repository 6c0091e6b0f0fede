"""Probe: one packed row's forward + backward, masked vs varlen attention (models/varlen.py).

A Qwen3-MoE (hidden 1024, 12 layers, 64 experts top-8) in bf16 on CUDA; packs of 16k tokens
cut into 128 x 128, 16 x 1024 and 8 x 2048 sequences; each mode twice (the first pair warms
up). Result: bench/results/varlen_probe_h200.txt. Run: python bench/gpu/varlen_probe.py
"""

from __future__ import annotations

import json
import time

import torch

from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model


def main() -> None:
    spec = ModelSpec.from_hf(tiny_config(
        "qwen3_moe", vocab_size=4096, hidden_size=1024, num_hidden_layers=12, num_experts=64,
        num_experts_per_tok=8, moe_intermediate_size=256, num_attention_heads=16, num_key_value_heads=4))
    model = build_model(spec, dtype=torch.bfloat16, device="cuda", seed=0)
    out: dict[str, float] = {}
    for n_seq, length in ((128, 128), (16, 1024), (8, 2048)):
        total = n_seq * length
        cu = torch.arange(0, total + 1, length, dtype=torch.int32, device="cuda")
        ids = torch.randint(0, 4096, (1, total), device="cuda")
        for mode in ("masked", "varlen", "masked", "varlen"):
            model.packed_attention = mode
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(ids, cu_seqlens=cu).logits.float().mean().backward()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            out[f"{n_seq}x{length}_{mode}_ms"] = dt * 1e3  # the second of each pair stays
            print(f"{n_seq} seqs x {length}: {mode} {dt * 1e3:.0f} ms", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
