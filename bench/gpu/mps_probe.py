"""Where non-finite values first appear in the e2e MoE model's forward on this GPU, as this
process's CUDA context is set up (run it with and without CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
under an MPS daemon). A diagnostic: the e2e MoE run under `engine.mps_thread_percent=40`
sampled NaN logits on the H200 (bench/results/e2e_async_mps_h200_s7.*).

Prints one line per check and, last, one JSON object.
"""

from __future__ import annotations

import json
import os

import torch

from miles.bench.e2e_gpu import MOE_SMALL
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model


def main() -> None:
    dev = torch.device("cuda")
    out: dict[str, object] = {"mps_thread_percent": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", ""),
                              "sm_count": torch.cuda.get_device_properties(dev).multi_processor_count}
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(256, 1024, generator=g)
    b = torch.randn(1024, 1024, generator=g)
    ref = a @ b
    got = (a.to(dev, torch.bfloat16) @ b.to(dev, torch.bfloat16)).float().cpu()
    out["bf16_mm_rel"] = float((got - ref).abs().max() / ref.abs().max())
    # which BLAS paths are wrong: each library torch can pick, dtypes, a decode-sized GEMM
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            for m in (8, 256):
                r = a[:m] @ b
                y = (a[:m].to(dev, dt) @ b.to(dev, dt)).float().cpu()
                out[f"mm_{lib}_{str(dt)[6:]}_m{m}_rel"] = float((y - r).abs().max() / r.abs().max())
    torch.backends.cuda.preferred_blas_library("default")
    q = torch.randn(4, 16, 128, 64, generator=g)
    want = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    sd = torch.nn.functional.scaled_dot_product_attention(*(q.to(dev, torch.bfloat16),) * 3, is_causal=True)
    out["sdpa_rel"] = float((sd.float().cpu() - want).abs().max() / want.abs().max())
    spec = ModelSpec.from_hf(tiny_config("qwen3_moe", vocab_size=151936, **MOE_SMALL))
    model = build_model(spec, torch.bfloat16, dev, seed=0)
    first: list[str] = []

    def hook(name: str):  # noqa: ANN202
        def f(_m, _i, o) -> None:  # noqa: ANN001
            t = o[0] if isinstance(o, tuple) else o
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not first and not bool(t.isfinite().all()):
                first.append(name)
        return f

    for name, m in model.named_modules():
        m.register_forward_hook(hook(name))
    ids = torch.randint(0, spec.vocab_size, (8, 64), generator=g).to(dev)
    with torch.no_grad():
        for impl in ("auto", "dense", "grouped_mm"):
            first.clear()
            for layer in model.model.layers:
                layer.mlp.experts.impl = impl
            logits = model(ids).logits
            out[f"forward_{impl}_finite"] = bool(logits.isfinite().all())
            out[f"forward_{impl}_first_nonfinite"] = first[0] if first else ""
    for k, v in out.items():
        print(f"{k:40s} {v}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
