"""Fault tolerance end to end: kill -9 the whole run and resume; kill an engine mid-run."""

from __future__ import annotations

import json
import os
import random
import signal
from collections import Counter
from pathlib import Path

import pytest

from .e2e_helpers import (
    check_ledger,
    children,
    kill_tree,
    metrics,
    resume_run,
    start_run,
    wait,
    wait_for,
)

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]


def test_kill_9_whole_run_then_resume(tmp_path: Path, miles_cache: Path) -> None:
    run, cache = tmp_path / "run", miles_cache
    # 40 steps: a quick-start step takes ~60 ms here, so 10 steps left the kill ~1 s to land
    # before the run ended by itself; 40 leave it some 2 s more
    p = start_run(run, cache, "--set", "run.steps=40", "--set", "trainer.checkpoint_interval=2")
    # Kill at a random moment after the first checkpoint exists.
    wait_for(lambda: (run / "checkpoints" / "latest").exists(), 240, "the first checkpoint")
    target = random.Random(os.getpid()).randint(3, 6)
    wait_for(lambda: len(metrics(run)) >= target or p.poll() is not None, 240, f"step {target}")
    kill_tree(p)
    assert not (run / "rollout_final.json").exists()
    # What the resumed run must keep: the prompts trained up to the checkpoint it resumes from.
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    saved = json.loads((ckpt / "rollout_state.json").read_text())["buffer"]["ledger"]["entries"]
    before = {e["prompt_id"]: e["trained_version"] for e in saved if e["state"] == "trained"}
    assert before
    q = resume_run(run, cache)
    assert wait(q, 300) == 0, (tmp_path / "run.launcher.log").read_text()[-3000:]
    # the steps after the checkpoint ran again and replaced the killed run's rows: none repeated
    assert [r["step"] for r in metrics(run)] == list(range(1, 41))
    final = check_ledger(run)  # ids unique, none lost, every drop has a reason
    after = {e["prompt_id"]: e["trained_version"] for e in final["buffer"]["ledger"]["entries"]
             if e["state"] == "trained"}
    # Identity, not a count: every prompt trained before the kill is still trained, by the same
    # step (the resumed run did not train it again) ...
    assert {p: after.get(p) for p in before} == before
    # ... and each of the 40 steps (one weight version each) trained exactly one batch of
    # distinct prompts.
    groups = json.loads((run / "config.resolved.json").read_text())["buffer"]["batch_groups"]
    per_step = Counter(after.values())
    assert len(per_step) == 40 and set(per_step.values()) == {groups}, per_step
    # resuming the finished run says so and launches nothing
    assert wait(resume_run(run, cache), 60) == 0
    assert "already finished (step 40 of run.steps=40)" in (tmp_path / "run.launcher.log").read_text()
    assert [r["step"] for r in metrics(run)] == list(range(1, 41))


def test_killed_engine_is_restarted_and_training_continues(tmp_path: Path, miles_cache: Path) -> None:
    run, cache = tmp_path / "run", miles_cache
    p = start_run(run, cache, "--set", "run.steps=12")
    try:
        wait_for(lambda: len(metrics(run)) >= 3, 240, "step 3")
        (engine,) = children(p.pid, "miles.launch.role engine")
        os.kill(engine, signal.SIGKILL)
        assert wait(p, 300) == 0, (tmp_path / "run.launcher.log").read_text()[-3000:]
    finally:
        if p.poll() is None:
            kill_tree(p)
    log = (tmp_path / "run.launcher.log").read_text()
    assert "role_crashed_restarting" in log
    assert [r["step"] for r in metrics(run)][-1] == 12
    final = check_ledger(run)
    led = final["buffer"]["ledger"]
    # The rollout saw the engine go down and come back (restarted, caught up to the current
    # weights); requests lost with it ran again once it was back, without failing a trajectory.
    assert final["routing"]["downs"] >= 1 and final["routing"]["ups"] >= 1, final["routing"]
    assert "failed" not in led["dropped_by_reason"] and "failed" not in led["drop_events"], led
