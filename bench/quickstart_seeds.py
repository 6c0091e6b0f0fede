"""Does the shipped quick start visibly learn on every seed? Runs it as a user would.

    nice -n 10 python bench/quickstart_seeds.py [--seeds 0 1 2] [--set KEY=VALUE ...]

Each seed is one `miles train examples/quickstart.toml --set run.seed=S` (its own warm-up,
cached after the first run). Per seed: reward mean over the first and the last quarter of
the steps, the rise between them, and the whole-command wall time. Goal: a rise of at least
+0.25 on every seed within 3 minutes on 2 cores. Prints a table; the last line is one JSON
object; the result goes to bench/results/quickstart_seeds_cpu.txt, and the first seed's
reward plot to bench/results/quickstart_reward_cpu.png (the README's curve).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from launched import train  # bench/ is on sys.path when this file runs as a script

REPO = Path(__file__).resolve().parents[1]
GOAL_RISE, GOAL_WALL_S = 0.25, 180.0


def run_seed(seed: int, sets: list[str], run_dir: Path) -> dict[str, float]:
    rows, wall = train(REPO / "examples" / "quickstart.toml",
                       [f"run.dir={run_dir}", f"run.seed={seed}", *sets], what=f"seed {seed}")
    r = [x["rollout/reward_mean"] for x in rows]
    q = max(1, len(r) // 4)
    first, last = sum(r[:q]) / q, sum(r[-q:]) / q
    return {"seed": seed, "steps": len(r), "first_quarter": first, "last_quarter": last, "rise": last - first,
            "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--set", action="append", default=[], help="quick-start override, KEY=VALUE")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "quickstart_seeds_cpu.txt"))
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for s in a.seeds:
            rows.append(run_seed(s, a.set, Path(tmp) / f"seed{s}"))
            print(f"seed {s}: rise {rows[-1]['rise']:+.3f}", file=sys.stderr, flush=True)
        first = Path(tmp) / f"seed{a.seeds[0]}"
        subprocess.run([sys.executable, "-m", "miles.launch.cli", "report", str(first), "--png"],
                       capture_output=True, check=True)
        if (first / "reward.png").is_file():
            shutil.copy(first / "reward.png", Path(a.out).with_name("quickstart_reward_cpu.png"))
    lines = [f"quick start, {os.cpu_count()} cores, load avg at end {os.getloadavg()[0]:.1f}, overrides {a.set}",
             f"{'seed':>4s} {'steps':>5s} {'first 1/4':>9s} {'last 1/4':>9s} {'rise':>7s} {'wall [s]':>8s}"]
    for r in rows:
        lines.append(f"{r['seed']:4d} {r['steps']:5d} {r['first_quarter']:9.3f} {r['last_quarter']:9.3f} "
                     f"{r['rise']:+7.3f} {r['wall_s']:8.1f}")
    ok = sum(r["rise"] >= GOAL_RISE for r in rows)
    lines.append(f"rise >= +{GOAL_RISE}: {ok}/{len(rows)} seeds; wall <= {GOAL_WALL_S:.0f} s: "
                 f"{sum(r['wall_s'] <= GOAL_WALL_S for r in rows)}/{len(rows)}")
    text = "\n".join(lines) + "\n" + json.dumps({"bench": "quickstart_seeds", "runs": rows, "rise_ok": ok,
                                                  "loadavg_end": os.getloadavg()[0]})
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
