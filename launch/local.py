"""Local launcher: every role as a process on this machine, supervised.

The head process runs the directory. It starts the engines, the rollout process
and the trainer ranks, forwards SIGINT/SIGTERM, restarts a crashed engine or
rollout process (the trainer re-syncs weights on its next version), and stops the
run when a trainer rank exits. It leaves no orphans: children are started in their
own process group and killed by PID on the way out.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from miles.actors.runtime.directory import Directory
from miles.actors.runtime.host import DIRECTORY_NAME, Host
from miles.core.config import dump_toml, to_dict
from miles.core.files import atomic_write_bytes
from miles.core.logging import get_logger
from miles.core.schema import MilesConfig
from miles.launch.console import Console
from miles.launch.supervision import RestartPolicy, crash_report
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
    served: bool = False  # its ready file appeared once: a later exit is not a failure at start
    log_from: int = 0  # where this incarnation's lines begin in log_path (the log is appended to)

    @property
    def ready_path(self) -> Path:
        return self.log_path.with_suffix(".ready")


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the launcher dies, even by SIGKILL (no orphans)."""
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def _free_port() -> int:
    """A free loopback port for the trainer ranks' process group (here, not from trainer.dist,
    so the launcher never imports torch: ~1 s of CPU before any role starts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
                               forward_warnings=cfg.run.log_json == "auto")

    def _spawn(self, c: Child) -> None:
        c.ready_path.unlink(missing_ok=True)  # written by this incarnation once it serves
        c.log_from = c.log_path.stat().st_size if c.log_path.exists() else 0
        log_f = c.log_path.open("ab")
        # stdout (prints, progress) apart from the JSON events; the console shows progress
        # from metrics.jsonl and warnings from the logs, so no role writes to the terminal
        out_f = c.log_path.with_suffix(".out").open("ab")
        c.proc = subprocess.Popen(c.argv, stdout=out_f, stderr=log_f, env=c.env, start_new_session=True,
                                  preexec_fn=_die_with_parent)
        c.started = time.monotonic()
        log.info("role_started", role=c.role, index=c.index, pid=c.proc.pid)

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
        cfg_path = self.run_dir / "config.resolved.json"
        cfg_path.write_text(json.dumps(to_dict(self.cfg), indent=1))
        (self.run_dir / "config.resolved.toml").write_text(dump_toml(self.cfg, with_docs=True))
        host = Host(self.cfg.transport, None)
        await host.start()
        await host.add(Directory(self.cfg.transport.heartbeat_timeout_s, self.cfg.transport.heartbeat_interval_s), DIRECTORY_NAME)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        env = {**os.environ, "MILES_DIRECTORY": host.address, "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(_free_port()), "PYTHONUNBUFFERED": "1", "MILES_RESUME": self.resume_from}
        base = [sys.executable, "-m", "miles.launch.role"]
        roles = [("engine", i) for i in range(self.cfg.engine.num_engines)] + [("rollout", 0)] + [
            ("trainer", r) for r in range(self.cfg.trainer.world_size)]
        if self.cfg.eval.mode == "snapshot":
            roles.insert(0, ("eval_engine", 0))  # a dedicated engine that evaluates weight snapshots
        for role, i in roles:
            log_path = self.run_dir / "logs" / f"{role}-{i}.log"
            argv = [*base, role, "--config", str(cfg_path), "--index", str(i), "--directory", host.address,
                    "--ready", str(log_path.with_suffix(".ready"))]
            c = Child(role, i, argv, {**env, "RANK": str(i), "WORLD_SIZE": str(self.cfg.trainer.world_size),
                                      **role_threads(role, roles)},
                      log_path)
            self.children.append(c)
            self._spawn(c)
        console_done = asyncio.Event()
        console = asyncio.create_task(self.console.follow(console_done), name="console")
        try:
            rc = await self._supervise()
        finally:
            console_done.set()
            await console
            # The directory (in this process) stays responsive while the roles shut down,
            # so they unregister cleanly instead of timing out against a blocked loop.
            await self._terminate()
            await host.stop(grace_s=1.0)
        return rc

    async def _supervise(self) -> int:
        while not self._stop.is_set():
            for c in self.children:
                assert c.proc is not None
                code = c.proc.poll()
                if code is None:
                    continue
                c.served = c.served or c.ready_path.exists()
                if c.role == "trainer":
                    if code == 0 and all(t.proc and t.proc.poll() is not None for t in self.children
                                         if t.role == "trainer"):
                        return 0
                    if code != 0:
                        log.error("trainer_exited", rank=c.index, code=code, cause=crash_report(c.log_path, c.log_from).reason,
                                  hint=f"see {c.log_path}; the last checkpoint is kept")
                        return code
                    continue
                report = crash_report(c.log_path, c.log_from)
                if c.role == "rollout":
                    # The buffer lives in the rollout process: restarting it empty would lose the
                    # in-flight prompts, so stop and let the user resume from the last checkpoint.
                    log.error("rollout_crashed" if c.served else "role_failed_at_start", role=c.role, code=code,
                              cause=report.reason, log=str(c.log_path),
                              hint=f"resume with: miles train --resume {self.run_dir}" if c.served else
                              "it would fail again: fix the cause and start again")
                    return 1
                decision = self.policy.decide(served=c.served, fatal=report.fatal, restarts=c.restarts)
                if decision.action == "stop":
                    log.error(decision.why, role=c.role, index=c.index, code=code, cause=report.reason,
                              log=str(c.log_path), restarts=c.restarts)
                    return 1
                c.restarts += 1
                log.warning(decision.why, role=c.role, index=c.index, code=code, restart=c.restarts,
                            cause=report.reason)
                # A restarted engine loads the initial weights; the trainer's next push (every
                # version is a full push) brings it to the current version, and anything it
                # generates before that is dropped as stale by the buffer.
                c.env = {**c.env, "MILES_RESUME": ""}
                self._spawn(c)
            try:
                await asyncio.wait_for(self._stop.wait(), 0.2)
            except TimeoutError:
                pass
        log.warning("run_interrupted")
        return 130

    async def _terminate(self, grace_s: float = 10.0) -> None:
        live = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for p in live:
            if p.poll() is None:
                p.kill()
                p.wait(5)
