"""The Slurm launcher on a real cluster: the quick start across two nodes, and a failing head step.

Needs a running Slurm cluster with at least two idle nodes (CI starts one with
scripts/slurm/local-cluster.sh); skipped otherwise. The run directory is under
pytest's tmp_path, which every virtual node of the local cluster shares.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "examples" / "quickstart.toml")


def _cluster_nodes() -> tuple[list[str], str]:
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return [], "no Slurm client (sinfo/sbatch) on PATH; CI starts one with scripts/slurm/local-cluster.sh"
    try:
        res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return [], "sinfo timed out: slurmctld is not answering"
    if res.returncode != 0:
        return [], f"sinfo failed ({res.stderr.strip()}): no running slurmctld"
    up = sorted({ln.split()[0] for ln in res.stdout.splitlines() if ln.split()[1:] in (["idle"], ["mix"])})
    if len(up) < 2:
        return up, f"need 2 idle Slurm nodes, sinfo shows: {res.stdout.strip() or 'none'}"
    return up, ""


NODES, WHY = _cluster_nodes()
pytestmark = [pytest.mark.skipif(bool(WHY), reason=WHY or "-"), pytest.mark.timeout(420), pytest.mark.slow]


def launch(tmp_path: Path, name: str, *sets: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    run = tmp_path / "run"
    args = [sys.executable, "-m", "miles.launch.cli", "launch", QUICKSTART, "--slurm", "--wait", "--time", "6",
            "--set", "run.steps=3", "--set", "run.warmup_sft_steps=10", "--set", f"run.dir={run}",
            "--set", f"run.name={name}", "--set", "run.log_json=json", *[x for s in sets for x in ("--set", s)]]
    try:
        res = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=400,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:
        # only this test's job carries this name; a timed-out test must not leave it running
        subprocess.run(["scancel", f"--name=miles-{name}"], capture_output=True)
    return res, run


def step_events(run: Path) -> dict[str, dict[str, object]]:
    out = {}
    for log in sorted((run / "logs").glob("*.log")):
        for line in log.read_text().splitlines():
            if line.startswith("{") and '"slurm_step"' in line:
                ev = json.loads(line)
                out[f"{ev['role']}-{ev['index']}"] = ev
    return out


def events(text: str) -> list[dict[str, object]]:
    """The JSON events among a job's output lines."""
    return [json.loads(ln) for ln in text.splitlines() if ln.startswith('{"')]


def test_quickstart_runs_across_two_nodes(tmp_path: Path) -> None:
    t0 = time.monotonic()
    res, run = launch(tmp_path, f"slurmci-{os.getpid()}")
    detail = f"stdout:\n{res.stdout}\nstderr:\n{res.stderr[-3000:]}"
    assert res.returncode == 0, detail
    assert "submitted job" in res.stdout
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows][-1] == 3 and all("rollout/reward_mean" in r for r in rows), rows
    assert (run / "final_hf" / "config.json").is_file()
    assert (run / "slurm" / "exit_code").read_text().strip() == "0"
    ev = step_events(run)
    assert set(ev) == {"head-0", "engine-0", "rollout-0", "trainer-0"}, ev
    # default placement: head, rollout and trainer on the first node, the engine on the second
    assert ev["engine-0"]["node"] == NODES[1] and ev["trainer-0"]["node"] == NODES[0], ev
    assert ev["head-0"]["node"] == NODES[0]
    job_log = next((run / "slurm").glob("slurm-*.out")).read_text()
    assert "miles: job exit code 0" in job_log, job_log
    print(f"slurm quickstart: {time.monotonic() - t0:.1f}s")


def test_failing_head_step_fails_the_job_with_the_cause_in_its_log(tmp_path: Path) -> None:
    res, run = launch(tmp_path, f"slurmci-bad-{os.getpid()}", "transport.interface=no-such-nic0")
    assert res.returncode == 1, f"{res.stdout}\n{res.stderr[-2000:]}"
    assert "no-such-nic0" in (run / "logs" / "head-0.log").read_text()
    job_log = next((run / "slurm").glob("slurm-*.out")).read_text()
    assert "head step exited before writing" in job_log, job_log
    assert not (run / "metrics.jsonl").exists()


def kill_step_in_allocation(tmp_path: Path, name: str, role: str,
                            steps_total: int) -> tuple[subprocess.Popen[str], str, Path, int]:
    """`miles launch --slurm` under salloc; SIGKILL to `role`'s step once the first step is recorded.
    Returns the launch, its output, the run dir and how many steps were recorded at the kill."""
    run = tmp_path / "run"
    args = ["salloc", "-N2", "--ntasks-per-node=3", "-t", "6", f"--job-name=miles-{name}",
            sys.executable, "-m", "miles.launch.cli", "launch", QUICKSTART, "--slurm",
            "--set", f"run.steps={steps_total}", "--set", "run.warmup_sft_steps=10", "--set", f"run.dir={run}",
            "--set", f"run.name={name}", "--set", "run.log_json=json"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        metrics = run / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first step"
            time.sleep(0.05)
        job = subprocess.run(["squeue", "-h", f"--name=miles-{name}", "-o", "%i"], capture_output=True,
                             text=True, check=True).stdout.split()
        assert len(job) == 1, job
        steps = subprocess.run(["squeue", "-h", "-s", "-j", job[0], "-o", "%i %j"], capture_output=True,
                               text=True, check=True).stdout.split("\n")
        target = [ln.split()[0] for ln in steps if ln.endswith(f" {role}")]
        assert len(target) == 1, steps
        subprocess.run(["scancel", "-s", "KILL", target[0]], capture_output=True)
        at_kill = len([x for x in metrics.read_text().splitlines() if x.strip()])
        out, _ = proc.communicate(timeout=max(10.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["scancel", f"--name=miles-{name}"], capture_output=True)
    return proc, out, run, at_kill


def test_inside_an_allocation_a_killed_engine_step_is_restarted(tmp_path: Path) -> None:
    """Under salloc the steps run directly; the engine step is killed once training has begun.

    The run has STEPS steps and the kill is sent as soon as the first one is recorded. Without an
    engine the trainer can take at most (max_staleness + 1) = 2 batches already generated, so
    with the kill sent before step STEPS - 2 the run can only finish through the restarted
    engine, which therefore serves and is stopped gracefully at the end. (With 4 steps, which
    this tiny model trains in ~0.3 s, the kill could land after the last step: the restarted
    engine was then cancelled while still importing. 20 steps: the kill lands at step 1-2, and the
    steps after the restart, ~0.1 s each, are no part of what is checked.)
    """
    steps_total = 20
    proc, out, run, at_kill = kill_step_in_allocation(tmp_path, f"slurmci-alloc-{os.getpid()}", "engine",
                                                      steps_total)
    assert at_kill < steps_total - 2, f"the kill landed after step {at_kill}: too late to need the restart"
    assert proc.returncode == 0, out[-3000:]
    assert "inside allocation" in out and "submitted job" not in out
    assert not list((run / "slurm").glob("slurm-*.out"))  # nothing went through sbatch
    restarts = [e for e in events(out) if e["event"] == "role_crashed_restarting"]
    assert [(e["role"], e["restart"], e["max_restarts"]) for e in restarts] == [("engine", 1, 3)], out[-3000:]
    assert "miles: job exit code 0" in out
    assert (run / "slurm" / "exit_code").read_text().strip() == "0"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert rows[-1]["step"] == steps_total
    ev = step_events(run)
    assert ev["engine-0"]["node"] == NODES[1] and ev["trainer-0"]["node"] == NODES[0], ev
    engine_log = (run / "logs" / "engine-0.log").read_text()
    # the restart appends: both incarnations' lines are in the log
    assert engine_log.count('"slurm_step"') == 2, engine_log[-3000:]
    # at the end the steps were asked to stop (SIGTERM to their tasks), not killed: each host drained
    for role in ("engine", "rollout", "head"):
        assert '"host_stopping"' in (run / "logs" / f"{role}-0.log").read_text(), role


def test_a_stopped_job_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """Stop a submitted run after a checkpoint (SIGTERM to the batch script = the supervisor: a
    graceful stop), then `miles launch --slurm --resume RUN --wait`: the steps continue from the
    checkpoint to the end, each recorded once."""
    name = f"slurmci-resume-{os.getpid()}"
    run = tmp_path / "run"
    # a checkpoint every 3 steps: the stop lands a step or two after the first (step 3). 40 steps
    # (~0.1 s each) leave it some 3 s before the last; 15 left about one, on a par with how long
    # scancel takes to reach the batch script on a loaded machine
    total = 40
    args = [sys.executable, "-m", "miles.launch.cli", "launch", QUICKSTART, "--slurm", "--time", "6",
            "--set", f"run.steps={total}", "--set", "run.warmup_sft_steps=10", "--set", f"run.dir={run}",
            "--set", f"run.name={name}", "--set", "run.log_json=json", "--set", "trainer.checkpoint_interval=3"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        first = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=200, env=env)
        assert first.returncode == 0 and "submitted job" in first.stdout, first.stdout + first.stderr
        job = first.stdout.split("submitted job ")[1].split(":")[0]
        deadline = time.monotonic() + 200
        from miles.actors.trainer import latest_checkpoint
        from miles.metrics.run_dir import checkpoint_step

        # a complete checkpoint (its `latest` pointer is written last): a stop that lands while the
        # first one is being written leaves nothing to resume from
        while latest_checkpoint(run) is None:
            assert time.monotonic() < deadline, "no checkpoint within 200 s"
            time.sleep(0.05)
        subprocess.run(["scancel", "-b", "-s", "TERM", job], check=True)  # the batch script only
        while not (run / "slurm" / "exit_code").is_file():
            assert time.monotonic() < deadline, "the stopped job did not end"
            time.sleep(0.2)
        stopped = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        assert (run / "slurm" / "exit_code").read_text().strip() == "130"
        assert stopped and stopped[-1] < total, f"the stop came after the last step: {stopped[-1:]}"
        newest = latest_checkpoint(run)
        assert newest is not None
        ckpt = checkpoint_step(newest)
        second = subprocess.run([sys.executable, "-m", "miles.launch.cli", "launch", "--slurm", "--resume",
                                 str(run), "--wait", "--time", "6"], cwd=tmp_path, capture_output=True, text=True,
                                timeout=300, env=env)
    finally:
        subprocess.run(["scancel", f"--name=miles-{name}"], capture_output=True)
    assert second.returncode == 0, second.stdout + second.stderr[-3000:]
    rows = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert rows == list(range(1, total + 1)), rows  # the steps past the checkpoint ran again, once each
    assert (run / "slurm" / "exit_code").read_text().strip() == "0"
    trainer = [json.loads(ln) for ln in (run / "logs" / "trainer-0.log").read_text().splitlines()
               if ln.startswith('{"')]
    resumed = [e for e in trainer if e["event"] == "resumed"]
    assert [e["step"] for e in resumed] == [ckpt], resumed
    rollout = (run / "logs" / "rollout-0.log").read_text()
    assert '"rollout_resumed"' in rollout
    # the stop was graceful: every step drained (its host stopping) before the job ended
    for role in ("engine", "rollout", "head"):
        assert (run / "logs" / f"{role}-0.log").read_text().count('"host_stopping"') == 2, role


def test_a_killed_rollout_step_is_not_restarted_and_the_job_names_the_resume(tmp_path: Path) -> None:
    """The rule `miles train` applies: the buffer lives in the rollout process, so a crashed
    rollout is not started again empty; the run stops (the other steps gracefully) and says how
    to resume."""
    proc, out, run, at_kill = kill_step_in_allocation(tmp_path, f"slurmci-rollout-{os.getpid()}", "rollout", 40)
    assert at_kill < 40, "the kill landed after the last step"
    assert proc.returncode == 1, out[-3000:]
    ev = events(out)
    assert not [e for e in ev if e["event"] == "role_crashed_restarting"], out[-3000:]
    crashed = [e for e in ev if e["event"] == "rollout_crashed"]
    assert len(crashed) == 1 and crashed[0]["hint"] == f"resume with: miles launch CONFIG --slurm --resume {run}"
    assert [e["role"] for e in ev if e["event"] == "step_started"].count("rollout") == 1
    assert (run / "slurm" / "exit_code").read_text().strip() == "1"
    for role in ("engine", "head"):
        assert '"host_stopping"' in (run / "logs" / f"{role}-0.log").read_text(), role
