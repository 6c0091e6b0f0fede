"""Local launcher: every role as a process on this machine, supervised.

The head process runs the directory. It starts the engines, the rollout process
and the trainer ranks, each a `Child` (a supervised unit), and hands them to the
supervisor shared with Slurm (launch/supervisor.py: which exits end the run, which
roles are restarted). It leaves no orphans: children are started in their own
process group and killed by PID on the way out.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from miles.actors.runtime.directory import Directory
from miles.actors.runtime.host import DIRECTORY_NAME, Host
from miles.core.files import atomic_write_bytes
from miles.core.logging import get_logger
from miles.core.ports import group_port
from miles.core.schema import MilesConfig
from miles.launch.console import Console
from miles.launch.supervision import CrashReport, RestartPolicy, crash_report
from miles.launch.supervisor import Supervisor, die_with_parent, stop_units
from miles.metrics.run_dir import resume_command, write_config
from miles.transport.curve import apply_cluster_keys

log = get_logger("miles.launch")


@dataclass
class Child:
    role: str
    index: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started: float = field(default_factory=time.monotonic)
    was_ready: bool = False  # its ready file appeared once: a later exit is not a failure at start
    log_from: int = 0  # where this incarnation's lines begin in log_path (the log is appended to)

    @property
    def ready_path(self) -> Path:
        return self.log_path.with_suffix(".ready")

    # the supervisor's Unit protocol (launch/supervisor.py)
    def start(self) -> None:
        self.ready_path.unlink(missing_ok=True)  # written by this incarnation once it serves
        self.log_from = self.log_path.stat().st_size if self.log_path.exists() else 0
        log_f = self.log_path.open("ab")
        # stdout (prints, progress) apart from the JSON events; the console shows progress
        # from metrics.jsonl and warnings from the logs, so no role writes to the terminal
        out_f = self.log_path.with_suffix(".out").open("ab")
        self.proc = subprocess.Popen(self.argv, stdout=out_f, stderr=log_f, env=self.env, start_new_session=True,
                                     preexec_fn=die_with_parent)
        self.started = time.monotonic()
        log.info("role_started", role=self.role, index=self.index, pid=self.proc.pid)

    def poll(self) -> int | None:
        assert self.proc is not None
        return self.proc.poll()

    def served(self) -> bool:
        self.was_ready = self.was_ready or self.ready_path.exists()
        return self.was_ready

    def crash(self) -> CrashReport:
        return crash_report(self.log_path, self.log_from)

    def log_hint(self) -> str:
        return str(self.log_path)

    def request_stop(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()


def role_threads(role: str, roles: list[tuple[str, int]]) -> dict[str, str]:
    """CPU threads for one role process, unless the user set OMP_NUM_THREADS.

    Every torch process defaults to one thread per core; several compute roles on one machine
    then oversubscribe it (on 2 cores the engine and the trainer would run 4 spinning threads).
    The cores are split between the compute roles (engines, trainer ranks); the rollout
    process, which only tokenizes and routes, gets one.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    compute = sum(1 for r, _ in roles if r != "rollout")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = 1 if role == "rollout" else max(1, cores // max(compute, 1))
    return {"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)}


class LocalLauncher:
    def __init__(self, cfg: MilesConfig, max_restarts: int = 3, resume_from: str = "") -> None:
        self.cfg = cfg
        self.resume_from = resume_from
        self.run_dir = Path(cfg.run.dir)
        self.children: list[Child] = []
        self.max_restarts = max_restarts
        self.policy = RestartPolicy(max_restarts)
        self._stop = asyncio.Event()
        self.console = Console(self.run_dir, cfg.run.steps, progress=cfg.run.progress,
                               forward_warnings=cfg.run.log_json == "file")

    async def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        if self.cfg.transport.curve:  # a fresh key set per launch; every role reads its paths from the config
            apply_cluster_keys(self.cfg.transport, self.run_dir / "keys")
            if self.cfg.rollout.http_front and not self.cfg.rollout.http_token_file:
                # the HTTP front is authenticated too: a bearer token beside the keys (0600)
                token = self.run_dir / "keys" / "http_token"
                atomic_write_bytes(token, secrets.token_urlsafe(32).encode(), 0o600)
                self.cfg.rollout.http_token_file = str(token)
        cfg_path = write_config(self.run_dir, self.cfg)
        host = Host(self.cfg.transport, None)
        await host.start()
        await host.add(Directory(self.cfg.transport.heartbeat_timeout_s, self.cfg.transport.heartbeat_interval_s), DIRECTORY_NAME)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        env = {**os.environ, "MILES_DIRECTORY": host.address, "PYTHONUNBUFFERED": "1", "MILES_RESUME": self.resume_from}
        if self.cfg.trainer.world_size > 1:  # one rank binds no port (trainer/dist.py)
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(group_port()))
        base = [sys.executable, "-m", "miles.launch.role"]
        roles = [("engine", i) for i in range(self.cfg.engine.num_engines)] + [("rollout", 0)] + [
            ("trainer", r) for r in range(self.cfg.trainer.world_size)]
        if self.cfg.eval.mode == "snapshot":
            roles.insert(0, ("eval_engine", 0))  # a dedicated engine that evaluates weight snapshots
        # the judge pool ([reward_model]): engines of a frozen model, supervised like the policy's
        roles[:0] = [("judge_engine", i) for i in range(self.cfg.reward_model.num_engines)]
        for role, i in roles:
            log_path = self.run_dir / "logs" / f"{role}-{i}.log"
            argv = [*base, role, "--config", str(cfg_path), "--index", str(i), "--directory", host.address,
                    "--ready", str(log_path.with_suffix(".ready"))]
            c = Child(role, i, argv, {**env, "RANK": str(i), "WORLD_SIZE": str(self.cfg.trainer.world_size),
                                      **role_threads(role, roles)},
                      log_path)
            self.children.append(c)
            c.start()
        console_done = asyncio.Event()
        console = asyncio.create_task(self.console.follow(console_done), name="console")
        supervisor = Supervisor(list(self.children), self.policy, resume_command(self.run_dir), self._stop)
        try:
            rc = await supervisor.run()
        finally:
            console_done.set()
            await console
            # The directory (in this process) stays responsive while the roles shut down,
            # so they unregister cleanly instead of timing out against a blocked loop.
            await stop_units(list(self.children), grace_s=10.0)
            await host.stop(grace_s=1.0)
        return rc
