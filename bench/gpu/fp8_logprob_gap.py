"""Benchmark: the train/rollout logprob gap with and without the FP8 contract (docs/fp8.md).

The engine samples completions (temperature 1) and reports each sampled token's logprob; the
trainer scores the same tokens with a full-sequence forward on the same weights. Reported per
mode: mean, p99 and max of |trainer - engine| over the sampled tokens, and the mean entropy of
the trainer's distributions (the gap grows with how peaked they are).

Modes (engine vs trainer, same seed-initialised weights):
- `base`: plain bf16 on both sides, no FP8: the gap the goal compares against.
- `contract_a16`: both under the contract; the engine on its FP8 codes with `engine.fp8_gemm`
  false (Ŵ rebuilt inside the Triton kernel, activations exact), the trainer on
  `dequant(quant(W))`. Goal: no worse than `base`.
- `contract_dequant`: the same, the engine's Ŵ materialised and multiplied by `F.linear`.
- `contract_a8`: the engine on FP8 GEMMs with activations rounded to FP8 (`fp8_gemm` true).
- `engine_only`: FP8 on the engine only (codes, exact activations), trainer plain bf16: what
  breaking the contract costs.
On the CPU (fp32) the kernels do not exist; every FP8 engine path there is the dequantized one,
so the contract modes show the exact equality of weights (gap as `base`) and `engine_only`
the cost of quantizing one side.

Random-init weights give near-uniform next-token distributions; the final norm is scaled by
`--norm-scale` (default 4) so the logits spread like a trained model's (entropy printed).
Last line: one JSON object. `--out FILE` also writes it there.
Run: python bench/gpu/fp8_logprob_gap.py [--device cuda] [--out F.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import torch

from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.torch_engine import TorchEngine
from miles.models import fp8_gemm
from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.models.fp8_layout import with_fp8
from miles.models.logprobs import token_logprobs
from miles.models.presets import tiny_config
from miles.models.registry import build_model

BLOCK = (128, 128)
# mode -> (engine under FP8, trainer under FP8, engine.fp8_gemm, FP8 kernels disabled for the engine)
MODES: dict[str, tuple[bool, bool, bool, tuple[str, ...]]] = {
    "base": (False, False, True, ()),
    "contract_a16": (True, True, False, ()),
    "contract_dequant": (True, True, False, fp8_gemm.KINDS),
    "contract_a8": (True, True, True, ()),
    "engine_only": (True, False, False, ()),
}


def _model(spec: ModelSpec, dtype: torch.dtype, device: str, state: dict[str, torch.Tensor]) -> CausalLM:
    """`spec`'s model (FP8 or not) on the shared weights `state` (one random init for all modes)."""
    model = build_model(spec, dtype=dtype)
    model.load_state_dict(state)
    return model.to(device)


def gap(cfg: dict[str, Any], device: str, modes: list[str], prompts: int, new: int,
        norm_scale: float) -> dict[str, dict[str, Any]]:
    dt = torch.bfloat16 if device != "cpu" else torch.float32
    plain = ModelSpec.from_hf(cfg)
    fp8 = with_fp8(plain, BLOCK)
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(0, cfg["vocab_size"], (16,), generator=g).tolist() for _ in range(prompts)]
    init = build_model(plain, dtype=dt, seed=0)
    with torch.no_grad():
        init.model.norm.weight.mul_(norm_scale)
    state = init.state_dict()
    out: dict[str, dict[str, Any]] = {}
    loop = asyncio.new_event_loop()
    for mode in modes:
        eng_fp8, tr_fp8, gemm_on, disabled = MODES[mode]
        saved = dict(fp8_gemm.broken)
        for kind in disabled:
            fp8_gemm.broken.setdefault(kind, "disabled by the bench")
        try:
            engine = TorchEngine(_model(fp8 if eng_fp8 else plain, dt, device, state),
                                 EngineConfig(device=device, max_batch_size=prompts, max_seq_len=16 + new + 8,
                                              fp8_gemm=gemm_on))
            trainer = _model(fp8 if tr_fp8 else plain, dt, device, state)

            async def go(engine: TorchEngine = engine) -> list[Any]:
                return list(await asyncio.gather(*(engine.generate(GenerateRequest(
                    input_ids=p, sampling=SamplingParams(temperature=1.0, max_new_tokens=new, seed=i)))
                    for i, p in enumerate(ps))))

            res = loop.run_until_complete(go())
            diffs, ents = [], []
            with torch.no_grad():
                for p, r in zip(ps, res, strict=True):
                    ids = torch.tensor([p + r.output_ids[:-1]], device=device)
                    lg = trainer(ids).logits[0, len(p) - 1:].float()
                    lp = token_logprobs(lg, torch.tensor(r.output_ids, device=device), 1.0).cpu()
                    diffs.append((lp - torch.tensor(r.logprobs)).abs())
                    logp = torch.log_softmax(lg, -1)
                    ents.append(-(logp.exp() * logp).sum(-1).cpu())
            loop.run_until_complete(engine.close())
            kernels = {k: v for k, v in fp8_gemm.broken.items() if v != "disabled by the bench"}
        finally:
            fp8_gemm.broken.clear()
            fp8_gemm.broken.update(saved)
        d = torch.cat(diffs)
        out[mode] = {"mean": float(d.mean()), "p99": float(d.quantile(0.99)), "max": float(d.max()),
                     "tokens": int(d.numel()), "entropy": float(torch.cat(ents).mean()), "kernels_refused": kernels}
    loop.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=0, help="sampled tokens per prompt; 0: 64 cuda, 16 cpu")
    ap.add_argument("--norm-scale", type=float, default=4.0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    cuda = a.device != "cpu"
    cfg = (tiny_config("qwen3", vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128) if cuda else
           tiny_config("qwen3", vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=128))
    modes = a.modes.split(",")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown mode {m!r}; choose from {', '.join(MODES)}")
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                           "dtype": "bf16" if cuda else "fp32", "model": {k: cfg[k] for k in (
                               "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")},
                           "norm_scale": a.norm_scale}
    res["gap"] = gap(cfg, a.device, modes, a.prompts, a.new or (64 if cuda else 16), a.norm_scale)
    print(f"{'mode':17} {'mean |dlogp|':>13} {'p99':>10} {'max':>10} {'tokens':>7} {'entropy':>8}")
    for k, v in res["gap"].items():
        print(f"{k:17} {v['mean']:>13.3e} {v['p99']:>10.3e} {v['max']:>10.3e} {v['tokens']:>7} {v['entropy']:>8.2f}"
              + (f"  refused: {v['kernels_refused']}" if v["kernels_refused"] else ""))
    res["kernel_pick"] = {str(k): v for k, v in fp8_gemm.timings.items()}  # us per kernel, per (act_fp8, M, N, K)
    if "base" in res["gap"]:
        res["ratio_to_base"] = {k: v["mean"] / max(res["gap"]["base"]["mean"], 1e-30) for k, v in res["gap"].items()}
    line = json.dumps(res)
    if a.out:
        with open(a.out, "w") as f:
            f.write(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
