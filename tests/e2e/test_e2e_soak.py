"""Chaos soak: a real CPU run while roles are SIGKILLed at random, 10% of reward calls fail or
stall, and the transport's fault hook drops and delays messages.

Bounded: chaos lasts `MILES_SOAK_S` seconds from the first checkpoint (the test runs only when it
is set; the issue's soak is 600), then the run is left to finish. The driver kills a random role
(engine, rollout, trainer) a few seconds after each new checkpoint, so the run keeps advancing
between kills, and resumes the run where the launcher does not restart the role (rollout,
trainer). The fault hook (`transport.faults`, transport/faults.py) drops 1% of the messages whose
loss the protocol recovers from (`engine.Generate` and `engine.GenerateMany` requests and
replies, `engine.Health`, `rollout.SetVersion`, `rt.Heartbeat`) and delays 5% of all messages by up to 100 ms.

A lost Generate fails its trajectory at `rollout.generate_timeout_s` (10 s here) and its group is
dropped (the prompt retried). The buffer takes groups in arrival order here: under the default
deadline schedule the batch a lost group was due in waits out that deadline, and at 1% loss
nearly every step did (~30 s a step at the default 32 s deadline).

At the end the ledger must account for every prompt drawn, no prompt trained twice, every drop
with a reason, and the run must have finished all its steps. Loopback only. Marked slow; opt-in.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from .e2e_helpers import check_ledger, children, kill_tree, metrics, resume_run, start_run

SOAK_S = float(os.environ.get("MILES_SOAK_S", "90"))
CALM_S = 1500.0  # after the chaos: time left for the run to finish its steps, resumes included
pytestmark = [
    pytest.mark.timeout(int(SOAK_S + CALM_S) + 900), pytest.mark.slow,
    # 12.3 minutes for 600 s of chaos on 2 cores, 1.5 for 60 s: more than the CI budget leaves, so opt-in.
    pytest.mark.skipif("MILES_SOAK_S" not in os.environ,
                       reason="chaos soak: set MILES_SOAK_S (seconds of chaos, e.g. 90 or 600) to run it"),
]
DROPPED_TYPES = ('["engine.Generate", "engine.GenerateMany", "engine.Health", "rollout.SetVersion", '
                 '"rt.Heartbeat"]')
CHAOS = ["--set", "rollout.reward_fn=miles.tests.e2e.chaos_reward:reward", "--set", "rollout.reward_errors=drop",
         "--set", "trainer.checkpoint_interval=2",
         "--set", "transport.faults.drop_rate=0.01", "--set", f"transport.faults.drop_types={DROPPED_TYPES}",
         "--set", "transport.faults.delay_rate=0.05", "--set", "transport.faults.delay_ms=100",
         "--set", "rollout.generate_timeout_s=10", "--set", "buffer.schedule=arrival"]


def _events(run: Path, launcher_log: Path) -> list[dict[str, Any]]:
    """Every structlog event of every process of the run (role logs, and the launcher's own)."""
    out: list[dict[str, Any]] = []
    for f in [*sorted((run / "logs").glob("*.log")), launcher_log]:
        for line in f.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                ev = json.loads(line)
            except ValueError:
                continue  # a line torn by a SIGKILL
            if f != launcher_log or ev.get("role") == "launcher":  # the launcher echoes role events
                out.append(ev)
    return out


def _fault_counts(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Messages dropped (each logged) and delayed (running totals per process: the last one
    logged by each; a SIGKILLed process loses at most its last second), and reward faults."""
    dropped = Counter(e["message"] for e in events if e.get("event") == "message_dropped")
    delayed: dict[int, int] = {}
    for e in events:
        if e.get("event") == "faults_injected":
            delayed[e["pid"]] = max(delayed.get(e["pid"], 0), int(e["delayed"]))
    reward = Counter(e["fault"] for e in events if e.get("event") == "chaos_reward_fault")
    return {"messages_dropped": sum(dropped.values()), "messages_dropped_by_type": dict(dropped),
            "messages_delayed_at_least": sum(delayed.values()), "reward_faults": dict(reward)}


def _latest(run: Path) -> str:
    try:
        return (run / "checkpoints" / "latest").read_text().strip()
    except OSError:
        return ""


def test_chaos_soak_accounts_for_every_prompt(tmp_path: Path, miles_cache: Path) -> None:
    run, cache = tmp_path / "run", miles_cache
    launcher_log = tmp_path / "run.launcher.log"
    rng = random.Random(os.getpid())
    # Kills come a few seconds after each new checkpoint (every 2 steps); a resume costs ~10-30 s
    # here, a step ~0.3-1 s. The run is long enough to outlast the chaos; the rest is finished in calm.
    steps = max(20, int(SOAK_S))
    p = start_run(run, cache, "--set", f"run.steps={steps}", *CHAOS)
    kills: Counter[str] = Counter()
    resumes = 0
    engine_kills_this_launch = 0
    t_end = float("inf")  # the chaos budget starts at the first checkpoint (after the warm-up)
    deadline = time.monotonic() + SOAK_S + 600  # the warm-up and the first steps, bounded
    killed_at = ""  # the checkpoint the last kill came after: the next waits for a newer one
    t_start = time.monotonic()
    try:
        # Chaos until the budget is spent (needs a first checkpoint to resume from).
        kill_at = float("inf")  # when the next kill is due (set once the run has made progress)
        while time.monotonic() < min(t_end, deadline):
            time.sleep(0.5)
            if p.poll() is not None:
                if p.returncode == 0:
                    break  # finished all its steps under chaos
                if not _latest(run):
                    raise AssertionError(f"the run died before its first checkpoint: rc {p.returncode}\n"
                                         + launcher_log.read_text()[-3000:])
                p = resume_run(run, cache)
                resumes += 1
                engine_kills_this_launch = 0
                continue
            latest = _latest(run)
            if not latest or latest == killed_at:
                continue  # no progress since the last kill yet
            if t_end == float("inf"):
                t_end = time.monotonic() + SOAK_S
            if kill_at == float("inf"):
                kill_at = time.monotonic() + rng.uniform(0.5, 4.0)  # at a random phase of a step
            if time.monotonic() < kill_at:
                continue
            # The launcher restarts an engine at most 3 times per launch.
            roles = ["rollout", "trainer"] + (["engine"] * 2 if engine_kills_this_launch < 3 else [])
            role = rng.choice(roles)
            pids = children(p.pid, f"miles.launch.role {role}")
            if not pids:
                continue
            os.kill(pids[0], signal.SIGKILL)
            kills[role] += 1
            killed_at, kill_at = latest, float("inf")
            engine_kills_this_launch += role == "engine"
        chaos_s = time.monotonic() - (t_end - SOAK_S)  # from the first checkpoint
        # Calm: let the run finish, resuming if the last kill stopped it.
        calm_end = time.monotonic() + CALM_S
        while True:
            try:
                rc = p.wait(max(1.0, calm_end - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the run did not finish within {CALM_S:.0f} s of calm; at step "
                                     f"{max([r['step'] for r in metrics(run)] or [0])} of {steps}") from None
            if rc == 0:
                break
            assert resumes < 200 and time.monotonic() < calm_end, launcher_log.read_text()[-3000:]
            p = resume_run(run, cache)
            resumes += 1
    finally:
        if p.poll() is None:
            kill_tree(p)
    total_s = time.monotonic() - t_start
    done = [r["step"] for r in metrics(run)]
    assert done and done[-1] == steps and set(range(1, steps + 1)) <= set(done)
    final = check_ledger(run)  # every prompt drawn is accounted for, each drop has a reason
    entries = final["buffer"]["ledger"]["entries"]
    trained = [e for e in entries if e["state"] == "trained"]
    groups = json.loads((run / "config.resolved.json").read_text())["buffer"]["batch_groups"]
    per_version = Counter(e["trained_version"] for e in trained)
    assert len(per_version) == steps and set(per_version.values()) == {groups}, per_version
    faults = _fault_counts(_events(run, launcher_log))
    settings = [CHAOS[i + 1] for i in range(0, len(CHAOS), 2)]
    report = {"soak_s": SOAK_S, "settings": settings, "load_avg_1_5_15": os.getloadavg(), "chaos_wall_s": round(chaos_s, 1), "total_wall_s": round(total_s, 1),
              "steps": steps, "kills": dict(kills), "kills_total": sum(kills.values()), "resumes": resumes,
              **faults, "prompts": len(entries), "trained": len(trained),
              "trained_twice": len(trained) - len({e["prompt_id"] for e in trained}),
              "dropped": sum(e["state"] == "dropped" for e in entries),
              "drop_reasons": dict(Counter(r for e in entries if e["state"] == "dropped"
                                           for r in e["reasons"][-1:]))}
    print("soak:", json.dumps(report))
    out = os.environ.get("MILES_SOAK_OUT")
    if out:
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    assert sum(kills.values()) >= 1 and faults["messages_dropped"] >= 1
