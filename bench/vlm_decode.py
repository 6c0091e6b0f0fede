"""Engine generation with images against text-only at the same token count (a part: the torch
engine alone on random weights, not a launched run).

Three cases on the same language model, each a batch of prompts of the same length followed
by greedy decoding to `--new` tokens (every request to its full length, no stop):
- `vl+images`: the VL model, each prompt one image (its placeholders expanded) plus text;
- `vl text`: the VL model, the same prompt length all text (M-RoPE, eager decode);
- `text model`: the language side alone as a plain Qwen2 model (CUDA-graph decode where on CUDA).
Reports wall time and generated tokens/s of the whole batch (prefill, the vision tower
included, plus decode).

    python bench/vlm_decode.py --device cuda --shape 3b --batch 32 --new 128
    python bench/vlm_decode.py --shape tiny --batch 4 --new 16      # CPU smoke run

Last line: one JSON object. Results: bench/results/vlm_decode_<shape>_<device>.txt (or --name).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2.5-VL-3B's tower (32 blocks of 1280, window attention, full at 7/15/23/31) over a
    # Qwen2.5-0.5B-shaped language side: the bench's dense model with a real-sized tower
    "3b": {"text": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                        num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 8, 8]}),
           "vision": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                          temporal_patch_size=2, spatial_merge_size=2, window_size=112, in_channels=3,
                          fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
           "image": 448},
    "tiny": {"text": {}, "vision": {}, "image": 32},
}


def build(shape: str, vocab: int, device: str, dtype: torch.dtype) -> tuple[Any, Any]:
    from miles.models.config import ModelSpec
    from miles.models.presets import tiny_config
    from miles.models.registry import build_model

    s = SHAPES[shape]
    text = dict(s["text"])
    vocab = int(text.pop("vocab_size", vocab))
    cfg = tiny_config("qwen2_5_vl", vocab_size=vocab, max_position_embeddings=8192, **text)
    if s["vision"]:
        cfg["vision_config"] = {**s["vision"], "out_hidden_size": cfg["text_config"]["hidden_size"]}
    vl = build_model(ModelSpec.from_hf(cfg), dtype=dtype, device=device, seed=0)
    plain_cfg = {**cfg["text_config"], "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    plain_cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": plain_cfg["rope_parameters"]["rope_theta"]}
    plain = build_model(ModelSpec.from_hf(plain_cfg), dtype=dtype, device=device, seed=0)
    return vl, plain


async def run_case(model: Any, prompts: list[list[int]], images: list[Any], new: int, batch: int,
                   device: str) -> dict[str, float]:
    from miles.core.schema.engine import EngineConfig
    from miles.engines.base import GenerateRequest, SamplingParams
    from miles.engines.torch_engine import TorchEngine

    longest = max(len(p) for p in prompts) + new + 8
    eng = TorchEngine(model, EngineConfig(max_batch_size=batch, max_seq_len=longest, kv_budget_tokens=0,
                                          device=device))
    await eng.warm_up()
    sp = SamplingParams(temperature=0.0, max_new_tokens=new)
    try:
        # a warm-up request (allocator, kernels), then the measured batch
        await eng.generate(GenerateRequest(prompts[0], SamplingParams(temperature=0.0, max_new_tokens=2),
                                           images=images[0]))
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()

        async def one(i: int) -> int:
            r = await eng.generate(GenerateRequest(prompts[i], sp, images=images[i]))
            return len(r.output_ids)

        done = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        wall = time.perf_counter() - t0
    finally:
        await eng.close()
    toks = sum(done)
    return {"wall_s": round(wall, 3), "tokens": toks, "tok_per_s": round(toks / wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--text", type=int, default=32, help="text tokens beside the image in each prompt")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--name", default="", help="results file stem (default vlm_decode_<shape>_<device>)")
    a = ap.parse_args()
    from miles.core.images import ImageInput, expand_placeholders, patchify

    dtype = getattr(torch, a.dtype) if a.device != "cpu" else torch.float32
    vl, plain = build(a.shape, 256, a.device, dtype)
    v = vl.spec.vision
    side = SHAPES[a.shape]["image"]
    rng = np.random.default_rng(0)
    imgs: list[ImageInput | None] = [patchify(rng.random((side, side, 3)), v.patch_size, v.temporal_patch_size,
                                              v.spatial_merge_size) for _ in range(a.batch)]
    n_img = imgs[0].tokens(v.spatial_merge_size)[0]  # type: ignore[union-attr]
    text = [int(t) for t in rng.integers(0, 200, a.text)]
    with_img = [expand_placeholders([*text[:4], v.image_token_id, *text[4:]], [n_img], v.image_token_id)
                for _ in range(a.batch)]
    plain_prompts = [[int(t) for t in rng.integers(0, 200, len(with_img[0]))] for _ in range(a.batch)]
    none: list[ImageInput | None] = [None] * a.batch
    res = {
        "vl+images": asyncio.run(run_case(vl, with_img, imgs, a.new, a.batch, a.device)),
        "vl text": asyncio.run(run_case(vl, plain_prompts, none, a.new, a.batch, a.device)),
        "text model": asyncio.run(run_case(plain, plain_prompts, none, a.new, a.batch, a.device)),
    }
    lines = [f"shape {a.shape}, {a.device} {a.dtype if a.device != 'cpu' else 'float32'}, batch {a.batch}, "
             f"prompt {len(with_img[0])} tokens ({n_img} image tokens per prompt in vl+images), {a.new} new tokens",
             "| case | wall s | tokens | tok/s |", "|---|---|---|---|"]
    lines += [f"| {k} | {r['wall_s']} | {r['tokens']} | {r['tok_per_s']} |" for k, r in res.items()]
    summary = json.dumps({"shape": a.shape, "device": a.device, "batch": a.batch, "new": a.new,
                          "prompt_tokens": len(with_img[0]), "image_tokens": n_img, **res})
    print("\n".join(lines))
    out = Path(__file__).resolve().parent / "results" / f"{a.name or f'vlm_decode_{a.shape}_{a.device}'}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n" + summary + "\n")
    print(summary)


if __name__ == "__main__":
    main()
