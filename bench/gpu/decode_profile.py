"""Where the torch engine's decode time goes on CUDA (issue 21): GPU busy share and top kernels.

For each model and case of bench/engine.py: one warm-up run of the engine (captures the decode
graphs), one timed run, then one run under torch.profiler. Reports the run's wall time, the
time the GPU spent in kernels (the union of kernel intervals), hence the share of the wall the
GPU idles waiting for the host, and the kernels with the most CUDA time. Then, on the warm
engine's stepper, the time of one graph replay alone and of the sampler alone per step.

    python bench/gpu/decode_profile.py --models dense,moe --cases b32,b128

A diagnostic, not a goal: the last line is one JSON object; results go to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: engine.py, engine_cases.py
from engine import EngineRun  # noqa: E402
from engine_cases import CASES, MODELS, prompts_for  # noqa: E402

from miles.engines.sampling import choose_tokens  # noqa: E402
from miles.models.config import ModelSpec  # noqa: E402
from miles.models.registry import build_model  # noqa: E402


def _busy_us(events: list[Any]) -> tuple[float, float]:
    """(union of kernel intervals, sum of kernel durations) in microseconds."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy, sum(e - s for s, e in spans)


def _timed(fn: Any, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def profile_case(kind: str, name: str, top: int, out: dict[str, Any]) -> None:
    cfg, case = MODELS["cuda"][kind], CASES["cuda"][name]
    model = build_model(ModelSpec.from_hf(cfg), dtype=torch.bfloat16, device="cuda", seed=0)
    run = EngineRun(model, "cuda", case, prompts_for(case, cfg["vocab_size"]), share=True)
    run()  # warm-up: captures the decode graphs
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t1 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall_prof = time.perf_counter() - t1
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy, total = _busy_us(kernels)
    key = f"{kind}_{name}"
    steps = case.new
    print(f"\n## {key}: batch {case.batch}, {case.prompt} prompt, {case.new} new")
    print(f"wall {wall * 1e3:.1f} ms ({case.batch * case.new / wall:.0f} tok/s), {wall / steps * 1e3:.3f} ms/step; "
          f"profiled run {wall_prof * 1e3:.1f} ms, kernels busy {busy / 1e3:.1f} ms "
          f"({busy / 1e3 / (wall_prof * 1e3):.0%} of the wall), kernel sum {total / 1e3:.1f} ms, "
          f"{len(kernels)} kernels ({len(kernels) / steps:.0f}/step)")
    by: dict[str, list[float]] = {}
    for e in kernels:
        by.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    rows = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:top]
    print(f"{'kernel':<90}{'calls':>7}{'us/step':>10}{'share':>8}")
    for k, v in rows:
        print(f"{k[:88]:<90}{len(v):>7}{sum(v) / steps:>10.1f}{sum(v) / total:>8.1%}")
    out[key] = {"tok_s": round(case.batch * case.new / wall, 1), "ms_per_step": round(wall / steps * 1e3, 3),
                "gpu_busy_share": round(busy / 1e3 / (wall_prof * 1e3), 3),
                "kernel_ms_per_step": round(busy / 1e3 / steps, 3), "kernels_per_step": round(len(kernels) / steps),
                "top": {k[:120]: round(sum(v) / steps, 1) for k, v in rows[:12]}}
    # the parts alone on the warm stepper: one replay of the decode graph; the sampler
    graphs = run.engine.stepper.graphs
    if graphs is not None and not graphs.failed:
        _parts(run, graphs, case, wall / steps, out[key])
    run.close()


@torch.inference_mode()  # the graphs' static inputs are inference tensors
def _parts(run: EngineRun, graphs: Any, case: Any, step_s: float, res: dict[str, Any]) -> None:
    """One replay of the decode graph (inputs included) and the sampler alone, on the warm engine."""
    b = case.batch
    lens = [case.prompt + case.new // 2] * b
    ids = [1] * b
    logits, _ = graphs.run(ids, lens, False)
    replay = _timed(lambda: graphs.run(ids, lens, False), 50)
    sample = _timed(lambda: choose_tokens(logits, run.sps, [None] * b, run.engine.stepper.rng), 50)
    print(f"graphs.run (inputs + replay) {replay * 1e3:.3f} ms; choose_tokens {sample * 1e3:.3f} ms; "
          f"rest of the step (scheduler, bookkeeping) {(step_s - replay - sample) * 1e3:.3f} ms")
    res.update(replay_ms=round(replay * 1e3, 3), sample_ms=round(sample * 1e3, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--cases", default="b32,b128")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_profile.py needs CUDA")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    out: dict[str, Any] = {}
    for kind in args.models.split(","):
        for name in args.cases.split(","):
            profile_case(kind, name, args.top, out)
            torch.cuda.empty_cache()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
