"""Benchmark: generation throughput of the torch engine vs transformers `generate`, same model and batch.

Cases (`--cases`; every case generates exactly `new` tokens per request, no early stop, greedy
unless said):

  cuda  b32 / b128   32 or 128 prompts of 128 tokens, 128 new (decode-heavy)
        group8x8     8 prompts x 8 samples (a GRPO group each), 1024-token prompts, 64 new
        b256         256 prompts of 128 tokens, 512 new
        group8x8_t1  group8x8 sampled at temperature 1 without seeds (as RL rollouts send)
        group8x8_t1_seeded  the same with a seed per request (a generator each)
  cpu   b8           8 prompts of 32 tokens, 64 new (the CPU bench of earlier runs)
        group2x4     2 prompts x 4 samples, 256-token prompts, 16 new

Models (`--models`): cpu tiny dense / MoE; cuda a Qwen2.5-0.5B-shaped dense and a Qwen3-MoE
(64 experts top-8, hidden 1024, 12 layers), random weights (fp32 on cpu, bf16 on cuda). The
engine replays decode steps as CUDA graphs (captured in the warm-up run) and prefills a group's
shared prompt once (`engine.share_prompts`); grouped cases also run it with sharing off.
The baseline is transformers `generate`: on cuda with `cache_implementation="static"`, which
torch.compiles the decode forward (compiled in its warm-up run), only for the `--hf` cases
(compiling is slow); on cpu with its defaults, for every case.

Tokens/s = generated tokens / wall time of the whole batch (prefill included), the median of
`--repeats` timed runs after one warm-up; HF and engine runs alternate so load from other
processes hits both alike. The SGLang column is not measured here: it is the SGLang 0.5.17
server (CUDA graphs on) of issue 21's H200 run, same models and lengths. Last line: one JSON
object; the cpu b8 case keeps the keys of earlier runs (`cpu_{dense|moe}_engine_tok_s`, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.models.hf_io import save_model
from miles.models.presets import tiny_config
from miles.models.registry import build_model

MODELS: dict[str, dict[str, dict[str, Any]]] = {
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


@dataclass(frozen=True)
class Case:
    prompts: int  # distinct prompts
    samples: int  # requests per prompt (a GRPO group's n)
    prompt: int  # tokens per prompt
    new: int  # tokens generated per request
    temperature: float = 0.0  # 0 = greedy
    seeded: bool = False  # temperature > 0: every request has a seed (its own stream); RL rollouts send none

    @property
    def batch(self) -> int:
        return self.prompts * self.samples


CASES: dict[str, dict[str, Case]] = {
    "cpu": {"b8": Case(8, 1, 32, 64), "group2x4": Case(2, 4, 256, 16)},
    "cuda": {
        "b32": Case(32, 1, 128, 128),
        "b128": Case(128, 1, 128, 128),
        "group8x8": Case(8, 8, 1024, 64),
        "b256": Case(256, 1, 128, 512),
        "group8x8_t1": Case(8, 8, 1024, 64, temperature=1.0),
        "group8x8_t1_seeded": Case(8, 8, 1024, 64, temperature=1.0, seeded=True),
    },
}

# tok/s of SGLang 0.5.17 (CUDA graphs on) in issue 21's H200 run: not measured by this script
SGLANG_ISSUE21: dict[tuple[str, str], float] = {
    ("dense", "b32"): 17300.0,
    ("dense", "b128"): 53600.0,
    ("dense", "group8x8"): 15400.0,
    ("moe", "b32"): 22100.0,
    ("moe", "b128"): 60400.0,
}


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def rounds(repeats: int, fns: list[Any], budget_s: float) -> list[list[float]]:
    """Warm every fn up, then `repeats` rounds of one timed run each, the order rotating per
    round (at least one round; fewer when the warm-up says they would overrun the budget)."""
    warm = sum(timed(f) for f in fns)
    if budget_s < float("inf"):
        repeats = max(1, min(repeats, int(budget_s / max(warm, 1e-9))))
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        for k in range(len(fns)):
            i = (k + r) % len(fns)
            times[i].append(timed(fns[i]))
    return times


def prompts_for(case: Case, vocab: int) -> torch.Tensor:
    """[batch, prompt] token ids; the samples of one prompt are consecutive rows, as a rollout
    sends a group's n requests."""
    g = torch.Generator().manual_seed(0)
    distinct = torch.randint(0, vocab, (case.prompts, case.prompt), generator=g)
    return distinct.repeat_interleave(case.samples, dim=0)


class EngineRun:
    """One engine sized for the case; `__call__` generates the whole batch once."""

    def __init__(
        self, model: CausalLM, device: str, case: Case, prompts: torch.Tensor, share: bool, compiled: bool = False
    ) -> None:
        cfg = EngineConfig(device=device, max_batch_size=case.batch, max_seq_len=case.prompt + case.new + 8,
                           kv_budget_tokens=0, share_prompts=share, compile_decode=compiled)
        self.engine = TorchEngine(model, cfg)
        self.loop = asyncio.new_event_loop()
        self.ids = [p.tolist() for p in prompts]
        self.sps = [SamplingParams(temperature=case.temperature, max_new_tokens=case.new,
                                   seed=i if case.seeded else None) for i in range(case.batch)]

    async def _all(self) -> None:
        await asyncio.gather(*(self.engine.generate(GenerateRequest(input_ids=p, sampling=sp))
                               for p, sp in zip(self.ids, self.sps, strict=True)))

    def __call__(self) -> None:
        self.loop.run_until_complete(self._all())

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.close())
        self.loop.close()


class HFRun:
    """transformers `generate` on one case; a failure is reported once and ends the baseline
    for that case (`failed`), not the benchmark."""

    def __init__(self, hf: Any, prompts: torch.Tensor, case: Case, static: bool) -> None:
        self.hf, self.case = hf, case
        self.ids = prompts.to(hf.device)
        self.mask = torch.ones_like(self.ids)  # every prompt token is real (0 is a token id, not padding)
        self.extra: dict[str, Any] = {"cache_implementation": "static"} if static else {}
        if case.temperature > 0:
            self.extra.update(do_sample=True, temperature=case.temperature, top_k=0, top_p=1.0)
        else:
            self.extra.update(do_sample=False)
        self.failed = ""

    def __call__(self) -> None:
        if self.failed:
            return
        try:
            with torch.no_grad():
                self.hf.generate(self.ids, attention_mask=self.mask, max_new_tokens=self.case.new,
                                 min_new_tokens=self.case.new, pad_token_id=0, eos_token_id=None, **self.extra)
        except Exception as exc:  # noqa: BLE001 - the baseline failing must not lose the engine's numbers
            self.failed = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"# hf baseline failed: {self.failed}", flush=True)


def hf_baseline(hf: Any, prompts: torch.Tensor, case: Case, gpu: bool) -> HFRun | None:
    """The HF run for one case, run once (on cuda: compiled for this batch from scratch, as a
    user running one shape would); None when it cannot run here."""
    if gpu:
        torch._dynamo.reset()  # a fresh static compile per case, not a dynamic-shape recompile
    run = HFRun(hf, prompts, case, static=gpu)
    t = timed(run)
    if run.failed:
        return None
    if gpu:
        print(f"# hf first run (static cache compile included): {t:.1f} s", flush=True)
    return run


def bench_model(kind: str, args: argparse.Namespace, out: dict[str, Any]) -> None:
    gpu = args.device == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    cfg = MODELS[args.device][kind]
    model = build_model(ModelSpec.from_hf(cfg), dtype=dtype, device=args.device, seed=0)
    hf = None
    if any(args.hf_all or f"{kind}:{c}" in args.hf for c in args.cases):
        with tempfile.TemporaryDirectory() as d:
            save_model(model, d)
            hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(args.device).eval()
    for name in args.cases:
        case = CASES[args.device][name]
        runs: dict[str, Any] = {}
        try:
            with_hf = hf if args.hf_all or f"{kind}:{name}" in args.hf else None
            tok, times = bench_case(model, with_hf, case, cfg["vocab_size"], args, runs)
        except Exception as exc:  # noqa: BLE001 - one case failing (e.g. out of memory) must not end the rest
            print(f"# {kind} {name} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            out[f"{kind}_{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            tok = {}
        for r in runs.values():
            if isinstance(r, EngineRun):
                r.close()
        runs.clear()
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
        if "engine" in tok:
            report(kind, name, case, tok, times, out, args.device)


def bench_case(
    model: CausalLM, hf: Any, case: Case, vocab: int, args: argparse.Namespace, runs: dict[str, Any]
) -> tuple[dict[str, float], list[list[float]]]:
    """Fill `runs` (the caller closes them) and time them -> (tok/s per run, times per run)."""
    prompts = prompts_for(case, vocab)
    runs["engine"] = EngineRun(model, args.device, case, prompts, share=True)
    if case.samples > 1 and not args.no_unshared:
        runs["engine_unshared"] = EngineRun(model, args.device, case, prompts, share=False)
    if hf is not None:
        run = hf_baseline(hf, prompts, case, args.device == "cuda")
        if run is not None:
            runs["hf"] = run
    times = rounds(args.repeats, list(runs.values()), args.budget_s)
    tok = {k: case.batch * case.new / statistics.median(t) for k, t in zip(runs, times, strict=True)
           if not (isinstance(runs[k], HFRun) and runs[k].failed)}
    return tok, times


def bench_compiled(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """The `--compile-cases` again with engine.compile_decode (after everything else: each
    engine compiles its decode forward in its warm-up, about a minute on cuda)."""
    by_model: dict[str, list[str]] = {}
    for item in args.compile_cases:
        kind, name = item.split(":")
        by_model.setdefault(kind, []).append(name)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    for kind, names in by_model.items():
        cfg = MODELS[args.device][kind]
        model = build_model(ModelSpec.from_hf(cfg), dtype=dtype, device=args.device, seed=0)
        for name in names:
            case = CASES[args.device][name]
            run = EngineRun(model, args.device, case, prompts_for(case, cfg["vocab_size"]), True, compiled=True)
            t0 = time.perf_counter()
            run()  # compile + capture
            print(f"# {kind} {name}+compile: first run {time.perf_counter() - t0:.1f} s "
                  f"(graphs failed: {run.engine.stepper.graphs.failed if run.engine.stepper.graphs else 'none'})",
                  flush=True)
            (times,) = rounds(args.repeats, [run], args.budget_s)
            run.close()
            report(kind, f"{name}+compile", case, {"engine": case.batch * case.new / statistics.median(times)},
                   [times], out, args.device)
        del model
        gc.collect()


def report(
    kind: str, name: str, case: Case, tok: dict[str, float], times: list[list[float]],
    out: dict[str, Any], device: str,
) -> None:
    sgl = SGLANG_ISSUE21.get((kind, name.removesuffix("+compile"))) if device == "cuda" else None
    en = tok["engine"]

    def cell(v: float | None, w: int, d: int = 1) -> str:
        return f"{v:>{w}.{d}f}" if v is not None else f"{'-':>{w}}"

    print(f"{kind:<6}{name:<20}{case.batch:>6}{case.prompt:>7}{case.new:>5}{cell(en, 13)}"
          f"{cell(tok.get('engine_unshared'), 13)}{cell(tok.get('hf'), 12)}"
          f"{cell(en / tok['hf'] if 'hf' in tok else None, 9, 2)}{cell(sgl, 12)}"
          f"{cell(en / sgl if sgl else None, 9, 2)}{len(times[0]):>5}", flush=True)
    key = f"{'gpu' if device == 'cuda' else 'cpu'}_{kind}_{name.replace('+', '_')}"
    out[f"{key}_engine_tok_s"] = round(en, 1)
    if "engine_unshared" in tok:
        out[f"{key}_engine_unshared_tok_s"] = round(tok["engine_unshared"], 1)
        out[f"{key}_share_speedup"] = round(en / tok["engine_unshared"], 3)
    if "hf" in tok:
        out[f"{key}_hf_tok_s"] = round(tok["hf"], 1)
        out[f"{key}_speedup_vs_hf"] = round(en / tok["hf"], 3)
    if sgl:
        out[f"{key}_vs_sglang_issue21"] = round(en / sgl, 3)
    if device == "cpu" and name == "b8":  # the keys of earlier CPU runs (bench/results/engine_cpu.txt)
        out[f"cpu_{kind}_engine_tok_s"] = round(en, 1)
        if "hf" in tok:
            out[f"cpu_{kind}_hf_tok_s"] = round(tok["hf"], 1)
            out[f"cpu_{kind}_speedup_vs_hf"] = round(en / tok["hf"], 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--models", default="dense,moe", help="comma list of dense, moe")
    ap.add_argument("--cases", default=None, help="comma list (default: every case of the device)")
    ap.add_argument("--hf", default=None,
                    help="comma list of model:case run with the HF baseline too, or 'all' "
                         "(cpu default: all; cuda default: dense:b32,dense:b128, each compiles ~1 min)")
    ap.add_argument("--compile-cases", default="",
                    help="comma list of model:case run once more, last, with engine.compile_decode (cuda)")
    ap.add_argument("--no-unshared", action="store_true", help="grouped cases: skip the share_prompts=false run")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per side (cpu: 7; cuda: 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for both sides")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="timed rounds per case stop at about this many seconds (cpu: no limit; cuda: 20)")
    ap.add_argument("--out", default="", help="also write the JSON object to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # the CPU box is shared; more threads only add noise
    gpu = args.device == "cuda"
    args.cases = args.cases.split(",") if args.cases else list(CASES[args.device])
    bad = [c for c in args.cases if c not in CASES[args.device]]
    if bad:
        sys.exit(f"--cases: unknown {bad} for {args.device}; choose from {list(CASES[args.device])}")
    models = args.models.split(",")
    if any(m not in MODELS[args.device] for m in models):
        sys.exit(f"--models: choose from {list(MODELS[args.device])}, got {models}")
    args.compile_cases = [c for c in args.compile_cases.split(",") if c]
    for item in args.compile_cases:
        kind, _, name = item.partition(":")
        if kind not in MODELS[args.device] or name not in CASES[args.device]:
            sys.exit(f"--compile-cases: {item!r} is not model:case of {args.device}")
    hf = args.hf if args.hf is not None else ("dense:b32,dense:b128" if gpu else "all")
    args.hf_all = hf == "all"
    args.hf = set(hf.split(",")) if hf and not args.hf_all else set()
    args.repeats = args.repeats or (3 if gpu else 7)
    args.budget_s = args.budget_s or (20.0 if gpu else float("inf"))
    out: dict[str, Any] = {"device": args.device, "cases": {n: vars(CASES[args.device][n]) for n in args.cases}}
    base = "HF static+compile" if gpu else "HF eager"
    print(f"# tok/s; engine_unshared: share_prompts=false; hf: {base}; "
          "sglang: SGLang 0.5.17, issue 21's run (not this run)")
    print(f"{'model':<6}{'case':<20}{'batch':>6}{'prompt':>7}{'new':>5}{'engine':>13}{'unshared':>13}"
          f"{'hf':>12}{'en/hf':>9}{'sglang':>12}{'en/sgl':>9}{'runs':>5}", flush=True)
    t0 = time.perf_counter()
    for kind in models:
        bench_model(kind, args, out)
    try:
        bench_compiled(args, out)
    except Exception as exc:  # noqa: BLE001 - an experimental variant must not cost the JSON line
        print(f"# compiled cases failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        out["compiled_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
