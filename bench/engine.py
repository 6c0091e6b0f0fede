"""Benchmark: generation throughput of the torch engine vs transformers `generate` and SGLang, same
model and batch, in the same run.

Cases (`--cases`; every case generates exactly `new` tokens per request, no early stop, greedy
unless said):

  cuda  b32 / b128   32 or 128 prompts of 128 tokens, 128 new (decode-heavy)
        group8x8     8 prompts x 8 samples (a GRPO group each), 1024-token prompts, 64 new
        b128_t1      b128 sampled at temperature 1 without seeds
        b256         256 prompts of 128 tokens, 512 new (long decode)
        group8x8_t1  group8x8 sampled at temperature 1 without seeds (as RL rollouts send)
        group8x8_t1_seeded  the same with a seed per request (a generator each)
  cpu   b8           8 prompts of 32 tokens, 64 new (the CPU bench of earlier runs)
        group2x4     2 prompts x 4 samples, 256-token prompts, 16 new

Models (`--models`): cpu tiny dense / MoE; cuda a Qwen2.5-0.5B-shaped dense and a Qwen3-MoE
(64 experts top-8, hidden 1024, 12 layers), random weights (fp32 on cpu, bf16 on cuda). The
engine runs with its defaults (`--engine-set KEY=VALUE` changes one): on cuda it replays decode
steps as CUDA graphs of a torch.compile'd forward, launched one step ahead of the host
(`engine.compile_decode`, `engine.overlap_decode`; compiled and captured in an untimed first run
per engine, whose time is printed), and it prefills a group's shared prompt once
(`engine.share_prompts`); grouped cases also run it with sharing off. `--plain-cases` runs cases
once more with graphs alone (neither compiled nor overlapped). On cpu every case also runs an
engine with `engine.compile_decode_cpu` (its decode forward compiled by Inductor; off by default;
compiled in its untimed first run, whose time is printed) in the same rounds: the `compiled`
line under each row and `*_compiled_*` keys (`--no-compiled` skips it).
The baseline is transformers `generate`: on cuda with `cache_implementation="static"`, which
torch.compiles the decode forward (compiled in its warm-up run), only for the `--hf` cases
(compiling is slow); on cpu with its defaults, for every case.

`--sglang` (cuda): a stock SGLang server per model, started through miles' SGLangEngine on the
same weights (saved in HF layout), CUDA graphs on up to the largest batch, runs the same requests
(greedy, ignore_eos, no stop ids, output logprobs returned), driven two ways (`--sglang-modes`):
`requests`, B concurrent single `/generate` requests (as a rollout sends them), and `batched`, one
`/generate` carrying the whole batch (SGLang's native batch API); the table reports each and the
engine's ratio to each. Its radix cache is flushed before every run, untimed (bench/engine_sglang.py). A server that fails to start or dies costs only the
SGLang column. The `sgl_i21` column is SGLang 0.5.17 in issue 21's H200 run (not this run).

Tokens/s = generated tokens / wall time of the whole batch (prefill included), the median of
`--repeats` timed runs after one warm-up (on cpu also by the process's CPU time, `*_cpu_tok_s`;
and the median of each round's own engine/HF ratio, `*_speedup_vs_hf_paired`, whose two runs
see the same load on a shared host); the engines' runs alternate so load from other
processes hits all alike. Every run must generate all its tokens (bench/engine_cases.py). Last
line: one JSON object (also written to `--out` after every case); the cpu b8 case keeps the keys
of earlier runs (`cpu_{dense|moe}_engine_tok_s`, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from engine_cases import (  # bench/ is on sys.path when this file runs as a script
    CASES,
    MODELS,
    SGLANG_ISSUE21,
    Case,
    check_results,
    prompts_for,
    requests_for,
    sampling_for,
)
from engine_sglang import SGLangRun, SGLangServerRun, sglang_config

from miles.core.schema.engine import EngineConfig
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.models.hf_io import save_model
from miles.models.registry import build_model

SGLANG_RUNS = {"requests": "sglang", "batched": "sglang_batched"}  # --sglang-modes -> key of the run


# CPU seconds (all threads of this process) of each fn's timed runs, by id(fn): on a shared
# CPU host the wall time of a run swings with the other jobs' load (+-30 % run to run on the
# 2-core box), so the CPU report gives CPU time beside it (`cpu_tok_s` keys). Not immune: on a
# VM a contended core's stolen time is counted, and at load ~9 it swung almost as much.
CPU_S: dict[int, list[float]] = {}


def timed(fn: Any) -> float:
    prepare = getattr(fn, "prepare", None)
    if prepare is not None:  # untimed set-up before each run (SGLang: flush its radix cache)
        prepare()
    c0 = time.process_time()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter() - t0
    CPU_S.setdefault(id(fn), []).append(time.process_time() - c0)
    return t


def prime(run: EngineRun, what: str) -> None:
    """One untimed run before the timed ones: the decode compile and graph captures happen here,
    so that the warm-up of `rounds` (which sizes the number of rounds) is a steady-state run."""
    t = timed(run)
    g = run.engine.stepper.graphs
    state = "no graphs" if g is None else "graphs failed" if g.failed else "compiled" if g.compiled else "uncompiled"
    if run.engine.device.type == "cuda" or g is not None:  # cpu: engine.compile_decode_cpu
        print(f"# {what}: {t:.1f} s ({state} decode {'graphs' if g is None or g.capture else 'forward'})", flush=True)


def rounds(repeats: int, fns: list[Any], budget_s: float) -> list[list[float]]:
    """Warm every fn up, then `repeats` rounds of one timed run each, the order rotating per
    round (at least one round; fewer when the warm-up says they would overrun the budget)."""
    warm = sum(timed(f) for f in fns)
    if budget_s < float("inf"):
        repeats = max(1, min(repeats, int(budget_s / max(warm, 1e-9))))
    times: list[list[float]] = [[] for _ in fns]
    for f in fns:  # the CPU times of these rounds only
        CPU_S.pop(id(f), None)
    for r in range(repeats):
        for k in range(len(fns)):
            i = (k + r) % len(fns)
            times[i].append(timed(fns[i]))
    return times


class EngineRun:
    """One engine sized for the case; `__call__` generates the whole batch once."""

    def __init__(
        self, model: CausalLM, device: str, case: Case, prompts: torch.Tensor, share: bool,
        settings: dict[str, Any] | None = None,
    ) -> None:
        cfg = EngineConfig(device=device, max_batch_size=case.batch, max_seq_len=case.prompt + case.new + 8,
                           kv_budget_tokens=0, share_prompts=share, **(settings or {}))
        self.engine = TorchEngine(model, cfg)
        self.loop = asyncio.new_event_loop()
        self.case = case
        self.ids = [p.tolist() for p in prompts]
        self.sps = sampling_for(case)

    async def _all(self) -> None:
        res = await asyncio.gather(*(self.engine.generate(r) for r in requests_for(self.ids, self.sps)))
        check_results(self.case, res, "engine")

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
    with contextlib.ExitStack() as stack:
        hf, sgl = None, None
        wants_hf = any(args.hf_all or f"{kind}:{c}" in args.hf for c in args.cases)
        if wants_hf or args.sglang:  # both load the engine's weights from one HF-layout folder
            ckpt = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"miles-bench-{kind}-"))
            save_model(model, ckpt)
            if wants_hf:
                import transformers  # only here: a --sglang run may not need it

                hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(args.device).eval()
            if args.sglang:
                sgl = start_sglang(kind, ckpt, args, out, stack)
        for name in args.cases:
            case = CASES[args.device][name]
            runs: dict[str, Any] = {}
            try:
                with_hf = hf if args.hf_all or f"{kind}:{name}" in args.hf else None
                tok, times = bench_case(model, with_hf, sgl, case, cfg["vocab_size"], args, runs)
            except Exception as exc:  # noqa: BLE001 - one case failing (e.g. out of memory) must not end the rest
                print(f"# {kind} {name} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                out[f"{kind}_{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                tok = {}
            for r in runs.values():
                if isinstance(r, EngineRun):
                    r.close()
            if "engine" in tok:
                report(kind, name, case, tok, times, out, args.device,
                       [r for k, r in runs.items() if k in SGLANG_RUNS.values()])
            runs.clear()
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
            save_json(out, args)


def start_sglang(
    kind: str, ckpt: str, args: argparse.Namespace, out: dict[str, Any], stack: contextlib.ExitStack
) -> SGLangServerRun | None:
    """This model's SGLang server, stopped when `stack` closes; None (the error in `out`) when it
    does not come up, and the torch engine's numbers are measured all the same."""
    stage = Path(args.sglang_dir) / kind
    port = args.sglang_port + list(MODELS[args.device]).index(kind)  # a server left over by a killed run is refused
    cfg = sglang_config(ckpt, [CASES[args.device][n] for n in args.cases], port, stage, args.sglang_python,
                        args.sglang_mem_fraction, args.sglang_start_s, args.sglang_args.split())
    server = SGLangServerRun(cfg, pid_file=stage / "server.pid")
    stack.callback(server.close)
    print(f"# {kind}: starting SGLang ({' '.join(cfg.sglang_extra_args)}; log {stage / 'server.log'})", flush=True)
    try:
        server.start()
    except Exception as exc:  # noqa: BLE001 - the torch engine's numbers must survive SGLang
        err = f"{type(exc).__name__}: {str(exc)[:400]}"
        print(f"# {kind}: SGLang did not start: {err}", flush=True)
        out[f"{kind}_sglang_error"] = err
        server.close()  # frees the GPU before the torch engine runs
        return None
    print(f"# {kind}: SGLang up in {server.start_s:.0f} s: {server.info}", flush=True)
    out.setdefault("sglang", {})[kind] = {"start_s": round(server.start_s, 1), "server": server.info,
                                          "flags": cfg.sglang_extra_args}
    return server


def bench_case(
    model: CausalLM, hf: Any, sgl: SGLangServerRun | None, case: Case, vocab: int, args: argparse.Namespace,
    runs: dict[str, Any],
) -> tuple[dict[str, float], list[list[float]]]:
    """Fill `runs` (the caller closes them) and time them -> (tok/s per run, times per run)."""
    prompts = prompts_for(case, vocab)
    runs["engine"] = EngineRun(model, args.device, case, prompts, share=True, settings=args.engine_set)
    if case.samples > 1 and not args.no_unshared:
        runs["engine_unshared"] = EngineRun(model, args.device, case, prompts, share=False, settings=args.engine_set)
    if args.device == "cpu" and not args.no_compiled:
        runs["engine_compiled"] = EngineRun(model, args.device, case, prompts, share=True,
                                            settings={**args.engine_set, "compile_decode_cpu": True})
    for key in [k for k in runs if k.startswith("engine")]:
        prime(runs[key], f"{key} first run")
    if hf is not None:
        run = hf_baseline(hf, prompts, case, args.device == "cuda")
        if run is not None:
            runs["hf"] = run
    if sgl is not None:
        for mode in args.sglang_modes:
            runs[SGLANG_RUNS[mode]] = sgl.run(case, runs["engine"].ids, batched=mode == "batched")
    times = rounds(args.repeats, list(runs.values()), args.budget_s)
    tok = {k: case.batch * case.new / statistics.median(t) for k, t in zip(runs, times, strict=True)
           if not getattr(runs[k], "failed", "")}
    if args.device == "cpu":
        tok.update({f"{k}_cpu": case.batch * case.new / statistics.median(CPU_S[id(r)]) for k, r in runs.items()
                    if k in tok and CPU_S.get(id(r))})
    if "hf" in tok:  # the median of each round's own ratio: the two runs of a round see the same load
        t = dict(zip(runs, times, strict=True))
        for k in ("engine", "engine_compiled"):
            if k in t:
                tok[f"hf_paired_speedup{k[6:]}"] = statistics.median(h / e for e, h in zip(t[k], t["hf"], strict=True))
    return tok, times


def bench_plain(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """The `--plain-cases` again with the decode graphs neither compiled nor overlapped
    (engine.compile_decode=false, overlap_decode=false: the engine before those defaults), after
    everything else."""
    by_model: dict[str, list[str]] = {}
    for item in args.plain_cases:
        kind, name = item.split(":")
        by_model.setdefault(kind, []).append(name)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    for kind, names in by_model.items():
        cfg = MODELS[args.device][kind]
        model = build_model(ModelSpec.from_hf(cfg), dtype=dtype, device=args.device, seed=0)
        for name in names:
            case = CASES[args.device][name]
            run = EngineRun(model, args.device, case, prompts_for(case, cfg["vocab_size"]), True,
                            settings={**args.engine_set, "compile_decode": False, "overlap_decode": False})
            prime(run, f"{kind} {name}+plain first run")
            (times,) = rounds(args.repeats, [run], args.budget_s)
            run.close()
            report(kind, f"{name}+plain", case, {"engine": case.batch * case.new / statistics.median(times)},
                   [times], out, args.device)
        del model
        gc.collect()


def report(
    kind: str, name: str, case: Case, tok: dict[str, float], times: list[list[float]],
    out: dict[str, Any], device: str, sgl_runs: list[SGLangRun] | None = None,
) -> None:
    i21 = SGLANG_ISSUE21.get((kind, name.removesuffix("+plain"))) if device == "cuda" else None
    en, sgl, sglb = tok["engine"], tok.get("sglang"), tok.get("sglang_batched")

    def cell(v: float | None, w: int, d: int = 1) -> str:
        return f"{v:>{w}.{d}f}" if v is not None else f"{'-':>{w}}"

    print(f"{kind:<6}{name:<20}{case.batch:>6}{case.prompt:>7}{case.new:>5}{cell(en, 13)}"
          f"{cell(tok.get('engine_unshared'), 13)}{cell(tok.get('hf'), 12)}"
          f"{cell(en / tok['hf'] if 'hf' in tok else None, 9, 2)}{cell(sgl, 12)}"
          f"{cell(en / sgl if sgl else None, 9, 2)}{cell(sglb, 12)}{cell(en / sglb if sglb else None, 9, 2)}"
          f"{cell(i21, 12)}"
          f"{cell(en / i21 if i21 else None, 9, 2)}{len(times[0]):>5}", flush=True)
    key = f"{'gpu' if device == 'cuda' else 'cpu'}_{kind}_{name.replace('+', '_')}"
    out[f"{key}_engine_tok_s"] = round(en, 1)
    if "engine_unshared" in tok:
        out[f"{key}_engine_unshared_tok_s"] = round(tok["engine_unshared"], 1)
        out[f"{key}_share_speedup"] = round(en / tok["engine_unshared"], 3)
    if "hf" in tok:
        out[f"{key}_hf_tok_s"] = round(tok["hf"], 1)
        out[f"{key}_speedup_vs_hf"] = round(en / tok["hf"], 3)
    if "hf_paired_speedup" in tok:
        out[f"{key}_speedup_vs_hf_paired"] = round(tok["hf_paired_speedup"], 3)
    if sgl:
        out[f"{key}_sglang_tok_s"] = round(sgl, 1)
        out[f"{key}_vs_sglang"] = round(en / sgl, 3)
    if sglb:
        out[f"{key}_sglang_batched_tok_s"] = round(sglb, 1)
        out[f"{key}_vs_sglang_batched"] = round(en / sglb, 3)
    for run in sgl_runs or []:
        tag = "sglang_batched" if run.batched else "sglang"
        if run.failed:
            out[f"{key}_{tag}_error"] = run.failed
        else:  # prompt tokens SGLang's radix cache reused inside the last run (a group's shared prompt)
            out[f"{key}_{tag}_cached_tokens"] = run.cached_tokens
    if i21:
        out[f"{key}_vs_sglang_issue21"] = round(en / i21, 3)
    if "engine_cpu" in tok and "hf_cpu" in tok:  # tok/s by process CPU time (see CPU_S)
        out[f"{key}_engine_cpu_tok_s"] = round(tok["engine_cpu"], 1)
        out[f"{key}_hf_cpu_tok_s"] = round(tok["hf_cpu"], 1)
        out[f"{key}_speedup_vs_hf_cpu"] = round(tok["engine_cpu"] / tok["hf_cpu"], 3)
        print(f"#   by CPU time: engine {tok['engine_cpu']:.1f}, hf {tok['hf_cpu']:.1f} tok/s, "
              f"en/hf {tok['engine_cpu'] / tok['hf_cpu']:.2f}; median of the rounds' own en/hf "
              f"{tok.get('hf_paired_speedup', float('nan')):.2f}", flush=True)
    if "engine_compiled" in tok:  # engine.compile_decode_cpu, in the same rounds
        co = tok["engine_compiled"]
        out[f"{key}_compiled_tok_s"] = round(co, 1)
        if "hf" in tok:
            out[f"{key}_compiled_speedup_vs_hf"] = round(co / tok["hf"], 3)
            out[f"{key}_compiled_speedup_vs_hf_paired"] = round(tok.get("hf_paired_speedup_compiled", 0.0), 3)
        print(f"#   compiled decode (engine.compile_decode_cpu): {co:.1f} tok/s, co/hf "
              f"{co / tok['hf'] if 'hf' in tok else float('nan'):.2f}, median of the rounds' own co/hf "
              f"{tok.get('hf_paired_speedup_compiled', float('nan')):.2f}", flush=True)
    if device == "cpu" and name == "b8":  # the keys of earlier CPU runs (bench/results/engine_cpu.txt)
        out[f"cpu_{kind}_engine_tok_s"] = round(en, 1)
        if "hf" in tok:
            out[f"cpu_{kind}_hf_tok_s"] = round(tok["hf"], 1)
            out[f"cpu_{kind}_speedup_vs_hf"] = round(en / tok["hf"], 3)


def save_json(out: dict[str, Any], args: argparse.Namespace) -> None:
    """`--out` holds what is measured so far (a run cut by a time limit keeps its finished cases)."""
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


def _terminated(signum: int, frame: Any) -> None:
    # `timeout` sends SIGTERM: unwind so that every launched SGLang server is stopped on the way out.
    raise SystemExit(128 + signum)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked and with the device's defaults filled in."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--models", default="dense,moe", help="comma list of dense, moe")
    ap.add_argument("--cases", default=None, help="comma list (default: every case of the device)")
    ap.add_argument("--hf", default=None,
                    help="comma list of model:case run with the HF baseline too, or 'all' "
                         "(cpu default: all; cuda default: dense:b32,dense:b128, each compiles ~1 min)")
    ap.add_argument("--engine-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an [engine] option for every torch engine run, e.g. compile_decode=false (repeatable)")
    ap.add_argument("--plain-cases", default="",
                    help="comma list of model:case run once more, last, with engine.compile_decode=false and "
                         "overlap_decode=false (decode graphs only: the engine before those defaults)")
    ap.add_argument("--no-unshared", action="store_true", help="grouped cases: skip the share_prompts=false run")
    ap.add_argument("--no-compiled", action="store_true",
                    help="cpu: skip the run with engine.compile_decode_cpu=true (its first run compiles, ~35 s)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per side (cpu: 7; cuda: 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for both sides")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="timed rounds per case stop at about this many seconds (cpu: no limit; cuda: 20)")
    ap.add_argument("--out", default="", help="also write the JSON object to this file (after every case)")
    sg = ap.add_argument_group("SGLang in the same run (cuda; bench/engine_sglang.py)")
    sg.add_argument("--sglang", action="store_true",
                    help="start a stock SGLang server per model (CUDA graphs on) and time it on the same requests")
    sg.add_argument("--sglang-modes", default="requests,batched",
                    help="comma list: requests (B concurrent single /generate requests), batched (one "
                         "/generate with the whole batch, SGLang's batch API)")
    sg.add_argument("--sglang-python", default="", help="python that runs sglang.launch_server ('' = this one)")
    sg.add_argument("--sglang-port", type=int, default=31000, help="port of the first model's server (+1 per model)")
    sg.add_argument("--sglang-mem-fraction", type=float, default=0.5,
                    help="--mem-fraction-static: GPU memory share of the server (the torch engine uses the rest)")
    sg.add_argument("--sglang-start-s", type=float, default=420.0, help="longest wait for a server to come up (s)")
    sg.add_argument("--sglang-args", default="", help="more launch_server arguments, space-separated")
    sg.add_argument("--sglang-dir", default="",
                    help="folder for each model's server.log and server.pid ('' = a temp dir)")
    args = ap.parse_args(argv)
    gpu = args.device == "cuda"
    args.cases = args.cases.split(",") if args.cases else list(CASES[args.device])
    bad = [c for c in args.cases if c not in CASES[args.device]]
    if bad:
        sys.exit(f"--cases: unknown {bad} for {args.device}; choose from {list(CASES[args.device])}")
    args.models = args.models.split(",")
    if any(m not in MODELS[args.device] for m in args.models):
        sys.exit(f"--models: choose from {list(MODELS[args.device])}, got {args.models}")
    args.plain_cases = [c for c in args.plain_cases.split(",") if c]
    for item in args.plain_cases:
        kind, _, name = item.partition(":")
        if kind not in MODELS[args.device] or name not in CASES[args.device]:
            sys.exit(f"--plain-cases: {item!r} is not model:case of {args.device}")
    args.engine_set = parse_engine_set(args.engine_set)
    args.sglang_modes = [m for m in args.sglang_modes.split(",") if m]
    if not args.sglang_modes or set(args.sglang_modes) - set(SGLANG_RUNS):
        sys.exit(f"--sglang-modes: choose one or more of {list(SGLANG_RUNS)}, got {args.sglang_modes}")
    hf = args.hf if args.hf is not None else ("dense:b32,dense:b128" if gpu else "all")
    args.hf_all = hf == "all"
    args.hf = set(hf.split(",")) if hf and not args.hf_all else set()
    args.repeats = args.repeats or (3 if gpu else 7)
    args.budget_s = args.budget_s or (20.0 if gpu else float("inf"))
    return args


def parse_engine_set(items: list[str]) -> dict[str, Any]:
    """--engine-set KEY=VALUE items -> EngineConfig keyword arguments, each checked against the
    dataclass (unknown keys and bad values exit with the option named)."""
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in fields:
            sys.exit(f"--engine-set {item!r}: expected KEY=VALUE with KEY one of EngineConfig's fields")
        default = getattr(EngineConfig(), key)
        if isinstance(default, bool):
            if raw.lower() not in ("true", "false"):
                sys.exit(f"--engine-set {item!r}: {key} takes true or false")
            out[key] = raw.lower() == "true"
        else:
            try:
                out[key] = type(default)(raw)
            except ValueError:
                sys.exit(f"--engine-set {item!r}: {key} takes a value of type {type(default).__name__}")
    return out


def main() -> None:
    args = parse_args()
    if args.sglang and args.device != "cuda":
        sys.exit("--sglang needs --device cuda (SGLang serves on a GPU)")
    if args.sglang:
        args.sglang_dir = args.sglang_dir or tempfile.mkdtemp(prefix="miles-bench-sglang-")
        signal.signal(signal.SIGTERM, _terminated)
    torch.set_num_threads(args.threads)  # the CPU box is shared; more threads only add noise
    gpu = args.device == "cuda"
    out: dict[str, Any] = {"device": args.device, "cases": {n: vars(CASES[args.device][n]) for n in args.cases}}
    base = "HF static+compile" if gpu else "HF eager"
    sgl = "SGLang in this run (CUDA graphs on)" if args.sglang else "not run (--sglang)"
    print(f"# tok/s; engine_unshared: share_prompts=false; hf: {base}; sglang: {sgl}, sgl_req: B concurrent "
          "single /generate requests, sgl_batch: one batched /generate; sgl_i21: SGLang 0.5.17 in issue 21's run "
          "(not this run)")
    print(f"{'model':<6}{'case':<20}{'batch':>6}{'prompt':>7}{'new':>5}{'engine':>13}{'unshared':>13}"
          f"{'hf':>12}{'en/hf':>9}{'sgl_req':>12}{'en/req':>9}{'sgl_batch':>12}{'en/batch':>9}{'sgl_i21':>12}"
          f"{'en/i21':>9}{'runs':>5}", flush=True)
    t0 = time.perf_counter()
    for kind in args.models:
        bench_model(kind, args, out)
    try:
        bench_plain(args, out)
    except Exception as exc:  # noqa: BLE001 - a comparison variant must not cost the JSON line
        print(f"# plain cases failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        out["plain_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    save_json(out, args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
