"""Inside a Slurm allocation: `python -m miles.launch.slurm_supervisor RUN_DIR`, what the sbatch script execs.

It runs the steps of `RUN/slurm/steps.json` (launch/slurm_script.py `JobSpec`), each an
`srun` that is one supervised unit (`SlurmStep`), under the supervisor `miles train` uses
(launch/supervisor.py): the head step first, the others once the head's address is in
`RUN/slurm/directory.addr`; the same restart rules, the same `--resume` checkpoint (through
MILES_RESUME, which srun passes to every task). At the end every step is asked to stop
(SIGTERM to its tasks, so they drain and unregister), the head last, and the run's exit code
goes to `RUN/slurm/exit_code` (read by `miles launch --wait`).

A graceful stop goes through `scancel -s TERM JOB.STEP`: srun itself turns a SIGTERM into a
hard kill of its tasks, so srun only gets one when the step outlives its grace time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from miles.core.config import from_dict
from miles.core.logging import configure_logging, get_logger
from miles.core.schema import MilesConfig
from miles.core.slurm_env import SlurmEnv
from miles.launch.slurm_script import JobSpec, StepCommand
from miles.launch.supervision import CrashReport, RestartPolicy, crash_report
from miles.launch.supervisor import Supervisor, die_with_parent, stop_units

log = get_logger("miles.launch")


def step_ids(job_id: str, name: str) -> list[str]:
    """The ids (JOB.STEP) of this job's running steps named `name`."""
    res = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"], capture_output=True, text=True)
    return [ln.split()[0] for ln in res.stdout.splitlines() if ln.split()[1:] == [name]]


@dataclass
class SlurmStep:
    """One role's srun step as a supervised unit (launch/supervisor.py `Unit`)."""

    cmd: StepCommand
    run_dir: Path
    job_id: str
    env: dict[str, str]
    index: int = 0
    restarts: int = 0
    proc: subprocess.Popen[bytes] | None = None
    was_ready: bool = False
    log_from: dict[Path, int] = field(default_factory=dict)  # where this incarnation's lines begin

    @property
    def role(self) -> str:
        return self.cmd.role

    def logs(self) -> list[Path]:
        return [self.run_dir / "logs" / f"{self.role}-{t}.log" for t in range(self.cmd.ntasks)]

    def ready_files(self) -> list[Path]:
        if self.role == "head":
            return [self.run_dir / "slurm" / "directory.addr"]
        return [p.with_suffix(".ready") for p in self.logs()]  # written by launch/role.py once it serves

    def start(self) -> None:
        for p in self.ready_files():
            p.unlink(missing_ok=True)
        self.log_from = {p: p.stat().st_size if p.exists() else 0 for p in self.logs()}
        # its own session: a Ctrl-C at the terminal reaches the supervisor only, which stops the
        # steps gracefully (srun would turn the SIGINT into a kill of its tasks)
        self.proc = subprocess.Popen(list(self.cmd.argv), env=self.env, start_new_session=True,
                                     preexec_fn=die_with_parent)
        log.info("step_started", role=self.role, srun_pid=self.proc.pid, restarts=self.restarts)

    def poll(self) -> int | None:
        assert self.proc is not None
        return self.proc.poll()

    def served(self) -> bool:
        self.was_ready = self.was_ready or any(p.exists() for p in self.ready_files())
        return self.was_ready

    def crash(self) -> CrashReport:
        reports = [crash_report(p, self.log_from.get(p, 0)) for p in self.logs()]
        # the task that raised names the cause; a task killed by --kill-on-bad-exit logs none
        return next((r for r in reports if r.fatal), None) or next((r for r in reports if r.reason), CrashReport())

    def log_hint(self) -> str:
        return str(self.run_dir / "logs" / f"{self.role}-*.log")

    def request_stop(self) -> None:
        for sid in step_ids(self.job_id, self.role):
            subprocess.run(["scancel", "-s", "TERM", sid], capture_output=True)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)  # srun ends its step's tasks hard


async def supervise(spec: JobSpec, job_id: str, stop: asyncio.Event) -> int:
    run = Path(spec.run_dir)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MILES_RESUME": spec.resume}
    units = [SlurmStep(c, run, job_id, dict(env)) for c in spec.steps]
    head = next(u for u in units if u.role == "head")
    others = [u for u in units if u is not head]
    spec.address_file.unlink(missing_ok=True)  # a stale address would send the steps to a dead directory
    head.start()
    rc = await _wait_head(head, spec, stop)
    try:
        if rc is None:
            log.info("directory_up", address=spec.address_file.read_text().strip())
            for u in others:
                u.start()
            resume_hint = f"miles launch CONFIG --slurm --resume {run}"
            rc = await Supervisor(list(units), RestartPolicy(spec.max_restarts), resume_hint, stop).run()
    finally:
        # the head goes last so the other steps can still unregister from the directory
        await stop_units([u for u in others if u.proc is not None], spec.stop_grace_s)
        await stop_units([head], spec.stop_grace_s)
        for u in units:  # an srun that outlived even its SIGTERM
            if u.proc is not None and u.proc.poll() is None:
                u.proc.kill()
                u.proc.wait(5)
    return rc


async def _wait_head(head: SlurmStep, spec: JobSpec, stop: asyncio.Event) -> int | None:
    """None once the head's address is written; else the run's exit code."""
    deadline = time.monotonic() + spec.directory_wait_s
    while not (spec.address_file.is_file() and spec.address_file.read_text().strip()):
        if head.poll() is not None:
            log.error("head_failed_at_start", code=head.poll(), cause=head.crash().reason, log=head.log_hint(),
                      hint=f"the head step exited before writing {spec.address_file}")
            return 1
        if stop.is_set():
            return 130
        if time.monotonic() > deadline:
            log.error("head_not_ready", address_file=str(spec.address_file), waited_s=spec.directory_wait_s,
                      hint="is the run directory on a filesystem every node shares?")
            return 1
        await asyncio.sleep(0.2)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="miles-slurm-supervisor")
    ap.add_argument("run_dir", help="the run directory `miles launch --slurm` prepared")
    a = ap.parse_args(argv)
    run = Path(a.run_dir)
    spec = JobSpec.read(run / "slurm" / "steps.json")
    cfg = from_dict(MilesConfig, json.loads((run / "config.resolved.json").read_text()))
    # as `miles train`: events as JSON to logs/launcher.log (file), warnings and errors as a line
    # here (the job's output)
    configure_logging(cfg.run.log_level, cfg.run.json_logs, file=cfg.run.launcher_log(run), run=cfg.run.name,
                      role="supervisor")
    exit_file = run / "slurm" / "exit_code"
    exit_file.unlink(missing_ok=True)
    job_id = SlurmEnv.from_environ().job_id

    async def go() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await supervise(spec, job_id, stop)

    rc = asyncio.run(go())
    exit_file.write_text(f"{rc}\n")
    print(f"miles: job exit code {rc}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
