"""Launched `miles train` runs with engine.type = "sglang" on one H200 (issue 35), against the
torch engine on the same workload. Not yet run: written to run in one call (sglang_e2e.sh).

Cases (each a launched run: engine, rollout and trainer roles, the SGLang server started by the
engine role through the recipe's flags, engine and trainer colocated on the GPU):
  dense-tensor   bench/e2e_gpu.py's ~1.3B Qwen2-shaped dense case, weights into SGLang in memory
                 (/update_weights_from_tensor, CUDA IPC handles of the engine's staging buffers)
  moe-tensor     bench/e2e_gpu.py's Qwen3-MoE case (64 experts top-8), R3 from SGLang's routed experts
  dense-disk     the dense case through /update_weights_from_disk (the path that reaches any server)
  qs-sglang-S    the quick start (tiny Qwen3-MoE, head_dim 64 so SGLang's rope kernel takes it) on CUDA,
                 seed S, SGLang engine
  qs-torch-S     the same with the torch engine (the reference spread for "learns as the torch engine does")
Reported per case: steps, median perf/sync_s and its share of the step, trained tok/s, the final
reward (quick start: the exact-match rate of sampled answers over the last quarter of the steps),
|logp train - rollout| (the trainer's logprob of the engine's tokens against the engine's).

Usage: python bench/gpu/sglang_e2e.py [--cases dense-tensor,moe-tensor,...] [--steps N] [--limit-s S]
       [--out FILE.json]    (a table, then one JSON line; the JSON file is rewritten after each case)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from e2e_gpu import run_case  # noqa: E402

from miles.core.config import load_config  # noqa: E402
from miles.core.logging import configure_logging  # noqa: E402
from miles.core.schema import MilesConfig  # noqa: E402
from miles.launch.local import LocalLauncher  # noqa: E402
from miles.metrics.sink import read_metrics  # noqa: E402
from miles.warmup.sft import with_initial_checkpoint  # noqa: E402

# The recipe's server flags (bench/gpu/README.md), CUDA graphs on.
SERVER_ARGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
               "--skip-server-warmup"]
SGLANG = ["engine.type=sglang", "engine.sglang_extra_args=" + json.dumps(SERVER_ARGS),
          "engine.sglang_startup_timeout_s=400", *os.environ.get("SGLANG_E2E_SETS", "").split()]


def commit() -> str:
    sha = os.environ.get("MILES_COMMIT", "")
    if sha:
        return sha
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


SIM_PYTHON = REPO / "tests" / "sglang_sim" / "python"


def quickstart(root: Path, case: str, steps: int, sim: bool = False) -> dict[str, Any]:
    _, engine, seed = case.split("-")
    run_dir = root / case
    dev = "cpu" if sim else "cuda"
    sets = [f"run.dir={run_dir}", f"run.steps={steps}", f"run.seed={seed}", "run.progress=false",
            "model.overrides.head_dim=64", f"engine.device={dev}", f"trainer.device={dev}"]
    if engine == "sglang":
        sets += SGLANG + ["engine.sglang_return_routed_experts=true"]
        if sim:  # the CPU rehearsal: tests/sglang_sim, a SIMULATION of SGLang's HTTP wire, not SGLang
            os.environ["MILES_SGLANG_SIM_PYTHON"] = sys.executable
            sets += [f"engine.sglang_python={SIM_PYTHON}"]
    cfg = with_initial_checkpoint(load_config(MilesConfig, REPO / "examples" / "quickstart.toml", sets))
    t0 = time.perf_counter()
    rc = asyncio.run(LocalLauncher(cfg).run())
    wall = time.perf_counter() - t0
    rows = read_metrics(run_dir / "metrics.jsonl")
    if rc != 0 or not rows:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((run_dir / "logs").glob("*.log")))
        raise RuntimeError(f"{case}: miles train exited {rc} after {len(rows)} steps\n{logs}")
    last = rows[-max(1, len(rows) // 4):]
    timed = rows[1:] or rows
    return {
        "case": case, "steps": len(rows), "wall_s": round(wall, 1),
        "reward_last_quarter": statistics.mean(r["rollout/reward_mean"] for r in last),
        "reward_first": rows[0]["rollout/reward_mean"],
        "sync_s_median": statistics.median(r["perf/sync_s"] for r in timed),
        "step_s_median": statistics.median(r["perf/step_time_s"] for r in timed),
        "logp_abs_diff_mean": statistics.mean(r.get("train/train_rollout_logprob_abs_diff", float("nan"))
                                              for r in rows),
    }


def bench_case(root: Path, case: str, steps: int, sim: bool = False) -> dict[str, Any]:
    if case.startswith("qs-"):
        return quickstart(root, case, steps or 200, sim)
    shape, update = case.split("-")
    r = run_case(root, shape, "cuda", steps or 12,
                 SGLANG + [f"engine.sglang_weight_update={update}", f"engine.sglang_return_routed_experts={str(shape == 'moe').lower()}"])
    return {"case": case, "steps": r["steps"], "wall_s": r["wall_s"], "sync_s_median": r["medians"].get("sync_s"),
            "step_s_median": r["medians"].get("step_time_s"), "sync_share": r["sync_share"],
            "trained_tok_s": r["trained_tok_s"], "sync_bytes": r["sync_bytes"], "reward_last": r["reward_last"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="dense-tensor,moe-tensor,qs-sglang-0,qs-torch-0,dense-disk,qs-sglang-1,"
                                       "qs-torch-1")
    ap.add_argument("--steps", type=int, default=0, help="0 = 12 (dense/moe) / 200 (quick start)")
    ap.add_argument("--limit-s", type=float, default=0, help="start no case after this many seconds (0 = none)")
    ap.add_argument("--out", default="bench/results/sglang_e2e_h200.json")
    ap.add_argument("--keep-logs", default="", help="copy each case's run folders (logs, metrics) here")
    ap.add_argument("--sim", action="store_true", help="CPU rehearsal of the quick-start cases against "
                    "tests/sglang_sim (a simulation of SGLang's wire, not SGLang)")
    a = ap.parse_args()
    configure_logging("error", None, run="bench", role="launcher")
    t0 = time.monotonic()
    results: list[dict[str, Any]] = []
    doc: dict[str, Any] = {"commit": commit(), "device": "", "server_args": SERVER_ARGS, "cases": results}
    try:
        import torch

        doc["device"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    with tempfile.TemporaryDirectory(prefix="miles-sglang-e2e-") as tmp:
        for case in a.cases.split(","):
            if a.limit_s and time.monotonic() - t0 > a.limit_s:
                results.append({"case": case, "skipped": "time limit"})
                continue
            try:
                results.append(bench_case(Path(tmp), case, a.steps, a.sim))
            except Exception as exc:  # noqa: BLE001 - one failed case must not lose the others
                results.append({"case": case, "error": f"{type(exc).__name__}: {exc}"[:4000]})
                print(traceback.format_exc(), file=sys.stderr)
            if a.keep_logs:  # every role's and the server's whole log, metrics, the console (not the weights)
                shutil.copytree(tmp, Path(a.keep_logs) / case, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
                    "*.safetensors", "*.pt", "final_hf", "tb", "checkpoints", "stage*"))
                shutil.rmtree(tmp, ignore_errors=True)
                Path(tmp).mkdir(exist_ok=True)
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"{'case':16s} {'steps':>5s} {'sync_s':>8s} {'step_s':>8s} {'reward':>7s}")
    for r in results:
        if "steps" in r:
            rew = r.get("reward_last_quarter", r.get("reward_last"))
            print(f"{r['case']:16s} {r['steps']:5d} {r['sync_s_median'] or 0:8.3f} {r['step_s_median'] or 0:8.3f} "
                  f"{rew if rew is not None else float('nan'):7.3f}")
        else:
            print(f"{r['case']:16s} {r.get('error', r.get('skipped', ''))[:100]}")
    print(json.dumps({"commit": doc["commit"], "cases": {r["case"]: {k: v for k, v in r.items() if k != "case"}
                                                       for r in results}}))


if __name__ == "__main__":
    main()
