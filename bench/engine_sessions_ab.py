"""A/B: a launched multi-turn run with and without engine sessions (`rollout.engine_sessions`).

With engine sessions, each in-process turn carries its session id to the engine, which keeps the
turn's KV, so the next turn prefills only the tokens its session appended; without, every turn
prefills its whole context. Runs `miles train` on the config (default: the two-turn VLM recipe,
examples/vlm_multiturn.toml) alternately with the option on and off, `--rounds` times each, and
reports per run: the rollout's prefix hit rate (engine-reused prompt tokens / prompt tokens, from
`rollout/prefix_hit_rate`), the RL steps/s (from the metrics' step times, warm-up and start
excluded), the training reward of the last quarter and the image-token mismatches (0 expected).

    python bench/engine_sessions_ab.py [--config examples/vlm_multiturn.toml] [--steps 150] [--rounds 2]

Last line: one JSON object. Results: bench/results/engine_sessions_ab_cpu.txt / .json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from launched import REPO, train  # bench/ is on sys.path when this file runs as a script

OUT = REPO / "bench" / "results"


def run(config: str, steps: int, on: bool, run_dir: Path, extra: list[str]) -> dict[str, Any]:
    sets = [f"run.dir={run_dir}", f"run.steps={steps}", f"rollout.engine_sessions={str(on).lower()}", *extra]
    rows, wall = train(config, sets)
    q = max(len(rows) // 4, 1)
    # steps/s over the run's second half: the first steps include the engines' and trainer's start
    half = rows[len(rows) // 2:]
    step_s = statistics.median(r["perf/step_time_s"] for r in half)
    return {"engine_sessions": on, "steps": len(rows), "wall_s": round(wall, 1),
            "prefix_hit_rate": round(float(rows[-1].get("rollout/prefix_hit_rate", 0.0)), 3),
            "engine_sessions_ended": int(rows[-1].get("rollout/engine_sessions_ended", 0)),
            "end_session_failures": int(rows[-1].get("rollout/end_session_failures", 0)),
            "median_step_s_2nd_half": round(step_s, 4),
            "reward_last_quarter": round(sum(r["rollout/reward_mean"] for r in rows[-q:]) / q, 3),
            "image_token_mismatches": sum(int(r.get("train/image_token_mismatches", 0)) for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "examples" / "vlm_multiturn.toml"))
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="more config overrides for both arms")
    ap.add_argument("--name", default="engine_sessions_ab_cpu")
    a = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="miles-sessions-ab-") as tmp:
        for i in range(a.rounds):
            for on in (True, False) if i % 2 == 0 else (False, True):  # alternate which arm goes first
                r = run(a.config, a.steps, on, Path(tmp) / f"r{i}-{int(on)}", a.set)
                runs.append(r)
                print(f"round {i} engine_sessions={on}: {r}", file=sys.stderr, flush=True)
    cols = list(runs[0])
    lines = [f"engine sessions A/B: launched `miles train` {Path(a.config).name}, {a.steps} steps, "
             f"{a.rounds} rounds alternating, this machine's CPU",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in runs]

    def med(on: bool, key: str) -> float:
        return statistics.median(float(r[key]) for r in runs if r["engine_sessions"] is on)

    summary = {"config": Path(a.config).name, "steps": a.steps, "rounds": a.rounds,
               "prefix_hit_rate_on": med(True, "prefix_hit_rate"), "prefix_hit_rate_off": med(False, "prefix_hit_rate"),
               "step_s_on": med(True, "median_step_s_2nd_half"), "step_s_off": med(False, "median_step_s_2nd_half"),
               "reward_last_quarter_on": med(True, "reward_last_quarter"),
               "reward_last_quarter_off": med(False, "reward_last_quarter"),
               "image_token_mismatches": sum(r["image_token_mismatches"] for r in runs), "runs": runs}
    summary["step_time_off_over_on"] = round(summary["step_s_off"] / max(summary["step_s_on"], 1e-9), 3)
    lines.append(f"median step time off / on: {summary['step_time_off_over_on']}; prefix hit rate on "
                 f"{summary['prefix_hit_rate_on']} vs off {summary['prefix_hit_rate_off']}")
    text = "\n".join(lines)
    print(text)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{a.name}.txt").write_text(text + "\n" + json.dumps(summary) + "\n")
    (OUT / f"{a.name}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
