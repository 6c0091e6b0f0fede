"""Chaos soak: a real CPU run while roles are SIGKILLed at random and 10% of reward calls fail or stall.

Bounded: chaos lasts `MILES_SOAK_S` seconds from the first checkpoint (the test runs only when it
is set; the issue's soak is 600), then the run is left to finish. The driver kills a random role (engine, rollout, trainer) every few seconds
and resumes the run where the launcher does not restart the role (rollout, trainer). At the
end the ledger must account for every prompt drawn, no prompt trained twice, every drop
with a reason, and the run must have finished all its steps. Loopback only. Marked slow.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from .e2e_helpers import check_ledger, children, kill_tree, metrics, resume_run, start_run

SOAK_S = float(os.environ.get("MILES_SOAK_S", "90"))
pytestmark = [
    pytest.mark.timeout(int(SOAK_S) + 900), pytest.mark.slow,
    # ~6 minutes for 90 s of chaos on 2 cores: more than the CI budget leaves, so opt-in.
    pytest.mark.skipif("MILES_SOAK_S" not in os.environ,
                       reason="chaos soak: set MILES_SOAK_S (seconds of chaos, e.g. 90 or 600) to run it"),
]
CHAOS = ["--set", "rollout.reward_fn=miles.tests.e2e.chaos_reward:reward", "--set", "rollout.reward_errors=drop",
         "--set", "trainer.checkpoint_interval=2"]


def test_chaos_soak_accounts_for_every_prompt(tmp_path: Path) -> None:
    run, cache = tmp_path / "run", tmp_path / "cache"
    rng = random.Random(os.getpid())
    steps = max(20, int(SOAK_S * 1.5))  # an RL step takes ~0.5-1 s here: chaos ends before the run
    p = start_run(run, cache, "--set", f"run.steps={steps}", *CHAOS)
    kills: Counter[str] = Counter()
    resumes = 0
    engine_kills_this_launch = 0
    t_end = float("inf")  # the chaos budget starts at the first checkpoint (after the warm-up)
    deadline = time.monotonic() + SOAK_S + 600  # the warm-up and the first steps, bounded
    try:
        # Chaos until the budget is spent (needs a first checkpoint to resume from).
        while time.monotonic() < min(t_end, deadline):
            time.sleep(rng.uniform(1.0, 5.0))
            if p.poll() is not None:
                if p.returncode == 0:
                    break  # finished all its steps under chaos
                if not (run / "checkpoints" / "latest").exists():
                    raise AssertionError(f"the run died before its first checkpoint: rc {p.returncode}\n"
                                         + (tmp_path / "run.launcher.log").read_text()[-3000:])
                p = resume_run(run, cache)
                resumes += 1
                engine_kills_this_launch = 0
                continue
            if not (run / "checkpoints" / "latest").exists():
                continue
            if t_end == float("inf"):
                t_end = time.monotonic() + SOAK_S
            roles = ["rollout", "trainer"] + (["engine"] * 2 if engine_kills_this_launch < 3 else [])
            role = rng.choice(roles)
            pids = children(p.pid, f"miles.launch.role {role}")
            if not pids:
                continue
            os.kill(pids[0], signal.SIGKILL)
            kills[role] += 1
            engine_kills_this_launch += role == "engine"
        # Calm: let the run finish, resuming once more if the last kill stopped it.
        for _ in range(3):
            rc = p.wait(600)
            if rc == 0:
                break
            p = resume_run(run, cache)
            resumes += 1
        assert p.returncode == 0, (tmp_path / "run.launcher.log").read_text()[-3000:]
    finally:
        if p.poll() is None:
            kill_tree(p)
    done = [r["step"] for r in metrics(run)]
    assert done and done[-1] == steps and set(range(1, steps + 1)) <= set(done)
    final = check_ledger(run)  # every prompt drawn is accounted for, each drop has a reason
    trained = [e for e in final["buffer"]["ledger"]["entries"] if e["state"] == "trained"]
    groups = json.loads((run / "config.resolved.json").read_text())["buffer"]["batch_groups"]
    per_version = Counter(e["trained_version"] for e in trained)
    assert len(per_version) == steps and set(per_version.values()) == {groups}, per_version
    report = {"soak_s": SOAK_S, "steps": steps, "kills": dict(kills), "kills_total": sum(kills.values()),
              "resumes": resumes, "prompts": len(final["buffer"]["ledger"]["entries"]),
              "trained": len(trained), "dropped": sum(e["state"] == "dropped"
                                                      for e in final["buffer"]["ledger"]["entries"])}
    print("soak:", json.dumps(report))
    out = os.environ.get("MILES_SOAK_OUT")
    if out:
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    assert sum(kills.values()) >= 1
