"""End to end on one GPU: launched `miles train` runs, each step broken into its phases.

Real runs (engine, rollout and trainer role processes over ZeroMQ, as `miles train` starts
them) on one device, engine and trainer colocated. The workload is long-tailed: every prompt
of the arithmetic env gets a log-normal `max_new_tokens` budget (rollout/envs/long_tail.py)
that it samples in full, so response lengths follow that distribution in every mode.

Cases (--device cuda, the H200):
  dense        Qwen2-shaped ~1.3B (hidden 1536, 28 layers), fully_async, 4-200 tokens
  moe          Qwen3-MoE (hidden 1024, 12 layers, 64 experts top-8, 2.55 GB fp32), fully_async, 4-400
  moe-sync     the same MoE run in sync mode (the fully_async vs sync comparison)
--device cpu runs tiny twins (a ~25M dense model: hidden 512, 8 layers; fp32 trainer, bf16
engine over zmq) so the script and the phase metrics are checked on any machine.

Reported per case, over every step after the first (which fills the pipeline and pays
start-up): median of each perf/* phase, the time to first step from the launch (`first_step_s`,
role start-up, model builds and compiles included; the initial checkpoint is written before, `init_s`), trained response tokens/s (sum / sum of step times),
the weight-update share of the step (sum perf/sync_s / sum perf/step_time_s), and the
trained/generated response-length ratio. Defaults are the user's: only the model, the
workload, the devices and `sync.transport` are set.

A case may carry its own overrides after '@': `moe@buffer.capacity=128@trainer.pause_engines=true`.

Usage: python bench/e2e_gpu.py [--device cuda|cpu] [--cases dense,moe,moe-sync] [--steps N]
       [--set KEY=VALUE ...] [--out FILE.json]            (last line: JSON)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

from miles.core.config import load_config  # noqa: E402
from miles.core.logging import configure_logging  # noqa: E402
from miles.core.schema import MilesConfig  # noqa: E402
from miles.launch.local import LocalLauncher  # noqa: E402
from miles.metrics.sink import read_metrics  # noqa: E402
from miles.warmup.sft import with_initial_checkpoint  # noqa: E402

DENSE_13B = {"hidden_size": 1536, "num_hidden_layers": 28, "intermediate_size": 8960,
             "num_attention_heads": 12, "num_key_value_heads": 2}
MOE_SMALL = {"hidden_size": 1024, "num_hidden_layers": 12, "num_experts": 64, "num_experts_per_tok": 8,
             "moe_intermediate_size": 256, "num_attention_heads": 16, "num_key_value_heads": 4}
DENSE_25M = {"hidden_size": 512, "num_hidden_layers": 8, "intermediate_size": 1536,
             "num_attention_heads": 8, "num_key_value_heads": 2}
MOE_TINY = {"hidden_size": 128, "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}

PHASES = ["perf/step_time_s", "perf/wait_rollout_s", "perf/train_s", "perf/sync_s", "perf/export_s",
          "perf/push_s", "perf/pause_s", "perf/transfer_s", "perf/commit_s", "perf/other_s"]


def case_sets(case: str, device: str) -> dict[str, Any]:
    """--set overrides of one case (everything else: examples/quickstart.toml and defaults)."""
    gpu = device == "cuda"
    moe = case.startswith("moe")
    arch = "qwen3_moe" if moe else "qwen2"
    shape = (MOE_SMALL if moe else DENSE_13B) if gpu else (MOE_TINY if moe else DENSE_25M)
    max_tokens = (400 if moe else 200) if gpu else 32
    groups, n = (16, 8) if gpu else (4, 4)
    sets: dict[str, Any] = {
        "run.warmup_sft_steps": 0, "run.progress": False, "run.log_level": "warning",
        "model.arch": arch, "model.overrides": "{" + ", ".join(f"{k} = {v}" for k, v in shape.items()) + "}",
        "engine.device": device, "engine.dtype": "bfloat16",
        "engine.max_batch_size": 2 * groups * n, "engine.max_seq_len": max_tokens + 64,
        "trainer.device": device, "trainer.routing_replay": moe,
        "trainer.micro_batch_tokens": 16384 if gpu else 4096,
        "rollout.env": "miles.rollout.envs.long_tail:make_env", "rollout.n_samples_per_prompt": n,
        "rollout.max_new_tokens": max_tokens,
        "rollout.env_args": (f'{{base = "miles.rollout.envs.arithmetic:make_env", median_tokens = '
                             f'{40 if gpu else 8}, sigma = 1.0, min_tokens = 4, max_tokens = {max_tokens}, '
                             f'seed = 0, ignore_stop = true}}'),
        "buffer.mode": "sync" if case.endswith("sync") else "fully_async",
        # capacity counts trajectories in flight: two steps' worth, as many as the engine batches
        "buffer.batch_groups": groups, "buffer.capacity": 2 * groups * n, "buffer.max_staleness": 2,
        "sync.transport": "cuda_ipc" if gpu else "zmq", "sync.bucket_mib": 512,
    }
    return sets


async def launch_watching(cfg: MilesConfig, metrics: Path, poll_s: float = 0.1) -> tuple[int, float | None]:
    """Run `miles train` and note when its first step lands in metrics.jsonl: the time to first
    step from the launch (role processes' start-up, model builds, compiles, the first batch)."""
    t0 = time.perf_counter()
    task = asyncio.ensure_future(LocalLauncher(cfg).run())
    first = None
    while not task.done():
        if first is None and metrics.exists() and metrics.stat().st_size > 0:
            first = time.perf_counter() - t0
            print(f"# first step after {first:.1f} s", flush=True)  # kept even if a time limit cuts the run
        await asyncio.wait([task], timeout=poll_s)
    if first is None and metrics.exists() and metrics.stat().st_size > 0:
        first = time.perf_counter() - t0  # landed within the last poll
    return task.result(), first


def run_case(root: Path, case: str, device: str, steps: int, extra: list[str]) -> dict[str, Any]:
    base, *own = case.split("@")  # "moe@trainer.pause_engines=true": a case with its own --set's
    run_dir = root / case.replace("@", "_")
    sets = {**case_sets(base, device), "run.steps": steps, "run.dir": str(run_dir)}
    extra = [*extra, *own]
    cfg = load_config(MilesConfig, REPO / "examples" / "quickstart.toml",
                      [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in sets.items()] + extra)
    t0 = time.perf_counter()
    cfg = with_initial_checkpoint(cfg)
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rc, first_step_s = asyncio.run(launch_watching(cfg, run_dir / "metrics.jsonl"))
    wall = time.perf_counter() - t0
    if rc != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted((run_dir / "logs").glob("*")))
        raise RuntimeError(f"{case}: miles train exited {rc}\n{logs}")
    rows = read_metrics(run_dir / "metrics.jsonl")
    timed = rows[1:] or rows
    step_s = sum(r["perf/step_time_s"] for r in timed)
    tokens = sum(r.get("rollout/trained_response_tokens", 0.0) for r in timed)
    samples = sum(r.get("rollout/trained_response_tokens", 0.0) / max(r.get("rollout/response_len_mean", 0.0), 1e-9)
                  for r in timed)
    gen_len = rows[-1].get("rollout/generated_response_len_mean", 0.0)
    med = {k: statistics.median(r[k] for r in timed) for k in PHASES if all(k in r for r in timed)}
    return {
        "case": case, "device": device, "steps": len(rows), "wall_s": round(wall, 2), "init_s": round(init_s, 2),
        "first_step_s": None if first_step_s is None else round(first_step_s, 2),
        "medians": {k.removeprefix("perf/"): round(v, 5) for k, v in med.items()},
        "sync_share": sum(r.get("perf/sync_s", 0.0) for r in timed) / step_s,
        "trained_tok_s": tokens / step_s, "trained_tokens": tokens, "sum_step_s": step_s,
        "len_ratio": (tokens / max(samples, 1e-9)) / gen_len if gen_len else None,
        "sync_bytes": rows[-1].get("sync/bytes"), "plan_declined": max(r.get("sync/plan_declined", 0) for r in rows),
        "sync_gbps_e2e": statistics.median(r.get("sync/gbps", 0.0) for r in timed),
        "transfer_gbps": statistics.median(r.get("sync/transfer_gbps", 0.0) for r in timed),
        "stale_dropped": sum(r.get("rollout/fully_async/stale_groups_filtered", 0.0) for r in rows),
        "reward_last": rows[-1].get("rollout/reward_mean"),
    }


def table(results: list[dict[str, Any]]) -> None:
    cols = ["step_time_s", "wait_rollout_s", "train_s", "sync_s", "export_s", "transfer_s", "commit_s"]
    print(f"{'case':40s} " + " ".join(f"{c.removesuffix('_s'):>12s}" for c in cols)
          + f" {'sync share':>10s} {'tok/s':>9s} {'len ratio':>9s} {'GB/version':>10s} {'declined':>8s}"
          f" {'1st step s':>10s}")
    for r in results:
        if "error" in r:
            print(f"{r['case']:40s} FAILED: {r['error'].splitlines()[0]}")
            continue
        m = r["medians"]
        print(f"{r['case']:40s} " + " ".join(f"{m.get(c, float('nan')):12.4f}" for c in cols)
              + f" {r['sync_share']:10.3f} {r['trained_tok_s']:9.0f} "
              f"{(r['len_ratio'] or 0):9.2f} {(r['sync_bytes'] or 0) / 1e9:10.3f} {r['plan_declined']:8.0f}"
              f" {r.get('first_step_s') or float('nan'):10.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--cases", default="dense,moe,moe-sync")
    ap.add_argument("--steps", type=int, default=0, help="0 = 12 (cuda) / 6 (cpu)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra KEY=VALUE for every case")
    ap.add_argument("--out", default="", help="write the results JSON here (also after each case)")
    ap.add_argument("--keep", default="", help="keep the runs' directories here")
    a = ap.parse_args()
    configure_logging("error", None, run="bench", role="launcher")
    steps = a.steps or (12 if a.device == "cuda" else 6)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="miles-e2e-gpu-") as tmp:
        root = Path(a.keep or tmp)
        for case in a.cases.split(","):
            try:
                results.append(run_case(root, case, a.device, steps, a.sets))
            except Exception as exc:  # noqa: BLE001 - one failed case must not lose the others' results
                results.append({"case": case, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})
                print(results[-1]["error"], file=sys.stderr)
            if a.out:
                Path(a.out).write_text(json.dumps(results, indent=1))
    table(results)
    by = {r["case"]: r for r in results if "error" not in r}
    summary: dict[str, Any] = {
        "device": a.device, "steps": steps,
        "sync_s_median": {c: r["medians"].get("sync_s") for c, r in by.items()},
        "sync_share": {c: round(r["sync_share"], 4) for c, r in by.items()},
        "trained_tok_s": {c: round(r["trained_tok_s"], 1) for c, r in by.items()},
        "len_ratio": {c: r["len_ratio"] and round(r["len_ratio"], 3) for c, r in by.items()},
        "first_step_s": {c: r.get("first_step_s") for c, r in by.items()},
        "failed": [r["case"] for r in results if "error" in r],
    }
    if "moe" in by and "moe-sync" in by:
        summary["async_vs_sync"] = round(by["moe"]["trained_tok_s"] / by["moe-sync"]["trained_tok_s"], 3)
    if "moe-sync" in by:  # every fully_async variant against sync at its defaults, same run
        summary["vs_sync"] = {c: round(r["trained_tok_s"] / by["moe-sync"]["trained_tok_s"], 3)
                              for c, r in by.items() if c.startswith("moe") and c != "moe-sync"}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
