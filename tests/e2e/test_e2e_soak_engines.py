"""Engine chaos soak: two engines, one SIGKILLed at a time, for `MILES_SOAK_S` seconds.

The driver waits until both engines run again (the launcher restarts a killed engine) and
the run trained a few steps since, then kills one of them at a random moment. The
launcher gives up on an engine after 3 restarts in one launch and stops the run; the
driver then resumes it from its latest checkpoint, so the chaos goes on.

What must hold: no trajectory fails for a death (a request lost with its engine is sent
to the survivor, so no prompt is dropped or retried as "failed"), the survivor keeps
training while the other is down (steps with `rollout/engines_down` = 1), the ledger
accounts for every prompt drawn, none is trained twice, and every step trains one batch.
Two workloads: the quick start (engines idle part of each step, waiting for the trainer), and
"busy" (tests/e2e/test_e2e_two_engines.py BUSY: engines never idle, so every kill catches
requests in flight). Opt-in and marked slow (set MILES_SOAK_S; MILES_SOAK_OUT=path.json
saves each report as path_<workload>.json).
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

import pytest

from .e2e_helpers import check_ledger, children, kill_tree, metrics, resume_run, start_run
from .test_e2e_soak import _events, _latest
from .test_e2e_two_engines import BUSY

SOAK_S = float(os.environ.get("MILES_SOAK_S", "60"))
pytestmark = [
    pytest.mark.timeout(int(SOAK_S) + 1200), pytest.mark.slow,
    pytest.mark.skipif("MILES_SOAK_S" not in os.environ,
                       reason="engine chaos soak: set MILES_SOAK_S (seconds of chaos, e.g. 120) to run it"),
]
SETTINGS = ["engine.num_engines=2", "run.warmup_sft_steps=0", "run.progress=false", "trainer.checkpoint_interval=5"]
STEPS_BETWEEN_KILLS = 3
# a restarted engine role is up and registered well within this (~3 s here); killing it while
# it starts is a failure at start, which the launcher rightly does not restart
ENGINE_START_S = 10.0


def _age_s(pid: int) -> float:
    """Seconds since the process started (from /proc: its start time in clock ticks after boot)."""
    start = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return float(Path("/proc/uptime").read_text().split()[0]) - start


def _index(pid: int) -> int:
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(cmd[cmd.index(b"--index") + 1]) if b"--index" in cmd else 0


@pytest.mark.parametrize("workload", ["quickstart", "busy"])
def test_engine_chaos_soak_loses_no_prompt(tmp_path: Path, workload: str, miles_cache: Path) -> None:
    run, cache = tmp_path / "run", miles_cache
    launcher_log = tmp_path / "run.launcher.log"
    rng = random.Random(os.getpid())
    steps = max(40, int(SOAK_S * 3))  # ~4-6 steps/s here between kills: the chaos ends first
    sets = [a for s in SETTINGS for a in ("--set", s)]
    extra = BUSY if workload == "busy" else []
    p = start_run(run, cache, *sets, *extra, "--set", f"run.steps={steps}")
    kills: Counter[str] = Counter()
    resumes = 0
    t0 = time.monotonic()
    t_end = t0 + SOAK_S
    last_kill_step = 0
    try:
        while time.monotonic() < t_end:
            time.sleep(0.3)
            if p.poll() is not None:
                if p.returncode == 0:
                    break  # finished all its steps under chaos
                assert _latest(run), launcher_log.read_text()[-3000:]
                p = resume_run(run, cache)
                resumes += 1
                last_kill_step = len(metrics(run))
                continue
            engines = children(p.pid, "miles.launch.role engine")
            done = len(metrics(run))
            try:
                started = len(engines) == 2 and min(_age_s(e) for e in engines) > ENGINE_START_S
            except OSError:
                continue
            if not started or done < last_kill_step + STEPS_BETWEEN_KILLS or not _latest(run):
                continue  # one at a time: both serve again and the run moved on since the last kill
            time.sleep(rng.uniform(0.0, 1.0))  # at a random phase of a step
            victim = rng.choice(engines)
            try:
                name = f"engine-{_index(victim)}"  # before the kill: a dead process has no cmdline
                os.kill(victim, signal.SIGKILL)
            except (OSError, ValueError):
                continue
            kills[name] += 1
            last_kill_step = done
        chaos_s = time.monotonic() - t0
        calm_end = time.monotonic() + 900
        while True:  # calm: let the run finish, resuming if the last kill stopped it
            try:
                rc = p.wait(max(1.0, calm_end - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError("the run did not finish within 900 s of calm") from None
            if rc == 0:
                break
            assert resumes < 100 and time.monotonic() < calm_end, launcher_log.read_text()[-3000:]
            p = resume_run(run, cache)
            resumes += 1
    finally:
        if p.poll() is None:
            kill_tree(p)
    rows = metrics(run)
    assert [r["step"] for r in rows][-1] == steps and set(range(1, steps + 1)) <= {r["step"] for r in rows}
    final = check_ledger(run)
    entries = final["buffer"]["ledger"]["entries"]
    trained = [e for e in entries if e["state"] == "trained"]
    per_version = Counter(e["trained_version"] for e in trained)
    assert len(per_version) == steps and set(per_version.values()) == {8}, per_version
    reasons = Counter(r for e in entries for r in e["reasons"])
    events = _events(run, launcher_log)
    downs = Counter(e["engine"] for e in events if e.get("event") == "engine_down")
    ups = Counter(e["engine"] for e in events if e.get("event") == "engine_up")
    report = {"soak_s": SOAK_S, "workload": workload, "settings": SETTINGS + extra[1::2], "load_avg_1_5_15": os.getloadavg(),
              "chaos_wall_s": round(chaos_s, 1), "total_wall_s": round(time.monotonic() - t0, 1), "steps": steps,
              "kills": dict(kills), "kills_total": sum(kills.values()), "resumes": resumes,
              "engine_down_events": dict(downs), "engine_up_events": dict(ups),
              "steps_with_an_engine_down": sum(r["rollout/engines_down"] >= 1 for r in rows),
              "requests_rerouted_last_launch": final["routing"]["lost_to_down_engine"],
              "groups_split_last_launch": final["routing"]["groups_split"],
              "prompts": len(entries), "trained": len(trained),
              "trained_twice": len(trained) - len({e["prompt_id"] for e in trained}),
              "drop_or_retry_reasons": dict(reasons)}
    print("soak:", json.dumps(report))
    out = os.environ.get("MILES_SOAK_OUT")
    if out:
        Path(out.replace(".json", f"_{workload}.json")).write_text(json.dumps(report, indent=1) + "\n")
    assert sum(kills.values()) >= 2 and sum(downs.values()) >= 1
    assert "failed" not in reasons, reasons  # no trajectory failed for a death
    assert report["trained_twice"] == 0
    assert report["steps_with_an_engine_down"] > 0  # the survivor trained alone meanwhile
    assert final["routing"]["groups_split"] == 0
