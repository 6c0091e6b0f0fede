"""The quick start against its last trusted result: reward rise, steps/s, sync ms, peak RSS.

    python bench/metric_history.py            # run the quick start once, compare, exit 1 outside a band
    python bench/metric_history.py --record   # also append this result as the new trusted one

CI runs it after the tests (.ci/run). The trusted results are the `history` list of
bench/results/metric_history_cpu.json; the last entry is the reference. Bands, wide on
purpose (CI machines differ in cores, clock and load; the point is to catch a broken
learner or a several-fold slowdown, not a few percent):

- reward rise (last-quarter minus first-quarter mean reward): >= reference - 0.15 and > 0.1
- steps/s over the training loop: >= reference / 3
- weight sync, median per step: <= 3 x reference + 20 ms
- peak RSS of the largest process of the run: <= 1.5 x reference + 200 MiB

Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HISTORY = REPO / "bench" / "results" / "metric_history_cpu.json"


def measure() -> dict[str, Any]:
    sys.path.insert(0, str(REPO.parent))
    from miles.launch.run_summary import summarize_run

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        t0 = time.time()
        p = subprocess.run([sys.executable, "-m", "miles.launch.cli", "train", str(REPO / "examples" / "quickstart.toml"),
                            "--set", f"run.dir={run}", "--set", "run.progress=false"],
                           capture_output=True, text=True, env={**os.environ})
        wall = time.time() - t0
        if p.returncode != 0:
            raise SystemExit(f"the quick start failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        s = summarize_run(run)
    rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # Linux: KiB, largest child
    assert s.reward is not None
    return {"reward_rise": s.reward[1] - s.reward[0], "reward_first": s.reward[0], "reward_last": s.reward[1],
            "steps_per_s": s.steps_per_s, "sync_ms": (s.sync_median_s or 0.0) * 1e3,
            "peak_rss_mib": rss_kib / 1024, "wall_s": wall, "steps": s.steps,
            "cpus": os.cpu_count(), "load1": os.getloadavg()[0]}


def bands(ref: dict[str, Any]) -> dict[str, tuple[str, float]]:
    """metric -> (">=" or "<=", bound) from the trusted reference."""
    return {"reward_rise": (">=", max(0.1, ref["reward_rise"] - 0.15)),
            "steps_per_s": (">=", ref["steps_per_s"] / 3),
            "sync_ms": ("<=", 3 * ref["sync_ms"] + 20.0),
            "peak_rss_mib": ("<=", 1.5 * ref["peak_rss_mib"] + 200.0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help="append this result to the trusted history")
    ap.add_argument("--history", default=str(HISTORY))
    a = ap.parse_args()
    path = Path(a.history)
    hist = json.loads(path.read_text()) if path.is_file() else {"history": []}
    got = measure()
    ok = True
    print(f"{'metric':14s} {'now':>10s} {'reference':>10s} {'band':>12s}  ok")
    verdict: dict[str, bool] = {}
    if hist["history"]:
        ref = hist["history"][-1]
        for k, (op, bound) in bands(ref).items():
            good = got[k] >= bound if op == ">=" else got[k] <= bound
            verdict[k] = good
            ok &= good
            print(f"{k:14s} {got[k]:10.3f} {ref[k]:10.3f} {op + f' {bound:.3f}':>12s}  {'yes' if good else 'NO'}")
    else:
        print("no trusted result yet: run with --record once on a quiet machine")
    if a.record:
        commit = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h"], capture_output=True,
                                text=True).stdout.strip()
        hist["history"].append({**got, "commit": commit, "date": time.strftime("%Y-%m-%d")})
        path.write_text(json.dumps(hist, indent=1) + "\n")
    print(json.dumps({**got, "within_band": ok, "verdict": verdict}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
