"""Benchmark: the engine's CPU MoE dispatch before and after session 18, paired in one process.

bench/engine.py's CPU MoE model and cases (`--cases`, default b8 and group2x4); one engine per
case, whose `Experts._cpu_inference` is switched between `old` (the dispatch before: dense by
`Experts`' multiply-add rule, else the Python loop `Experts._grouped`) and `new` (models/moe_cpu.py:
dense by `prefer_dense`, else `torch._grouped_mm`) run by run, order alternating, so both see the
same load. Reports the process's CPU time per generate run (median over `--rounds`). Last line: one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from engine import EngineRun  # bench/ is on sys.path when this file runs as a script
from engine_cases import CASES, MODELS, prompts_for

from miles.models.config import ModelSpec
from miles.models.moe import Experts
from miles.models.registry import build_model


def old_dispatch(self: Experts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n, k = ids.shape
    e, two_i, h = self.gate_up_proj.shape
    if n * (e - k) * (two_i + self.inter) * h <= e * 3e5:
        return self._dense(x, ids, w)
    return self._grouped(x, ids, w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="group2x4,b8")
    ap.add_argument("--rounds", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = MODELS["cpu"]["moe"]
    model = build_model(ModelSpec.from_hf(cfg), dtype=torch.float32, device="cpu", seed=0)
    ways: dict[str, Callable[..., torch.Tensor]] = {"old": old_dispatch, "new": Experts._cpu_inference}
    out: dict[str, dict[str, float]] = {}
    print(f"{'case':<10}{'old ms':>9}{'new ms':>9}{'old/new':>9}   (CPU ms per generate run, median)")
    for name in args.cases.split(","):
        case = CASES["cpu"][name]
        run = EngineRun(model, "cpu", case, prompts_for(case, cfg["vocab_size"]), True)
        run()  # warm-up
        times: dict[str, list[float]] = {w: [] for w in ways}
        try:
            for r in range(args.rounds):
                for way in (("old", "new") if r % 2 else ("new", "old")):
                    Experts._cpu_inference = ways[way]  # type: ignore[method-assign]
                    t = time.process_time()
                    run()
                    times[way].append(time.process_time() - t)
        finally:
            Experts._cpu_inference = ways["new"]  # type: ignore[method-assign]
            run.close()
        old, new = (statistics.median(times[w]) * 1000 for w in ("old", "new"))
        out[name] = {"old_ms": round(old, 1), "new_ms": round(new, 1), "old_over_new": round(old / new, 3)}
        print(f"{name:<10}{old:>9.1f}{new:>9.1f}{old / new:>9.3f}", flush=True)
    print(json.dumps({"moe_dispatch_ab_cpu": out, "rounds": args.rounds}))


if __name__ == "__main__":
    main()
