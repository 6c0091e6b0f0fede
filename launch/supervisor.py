"""The one supervisor of a run's role processes, for the local launcher and for Slurm.

A `Unit` is something that runs one role and can be started again: a local process (one
engine, the rollout process, one trainer rank; launch/local.py) or a Slurm step (all tasks
of a role, one `srun`; launch/slurm_supervisor.py). `Supervisor.run` watches the units and
applies the same rules to both:

- the run ends when every trainer unit has exited 0, or with the code of the first one that
  fails (the last checkpoint is kept);
- the head (the directory, a unit only under Slurm; locally it lives in the launcher) ending
  ends the run: no role can find another without it;
- the rollout process is never restarted: the buffer lives in it, and a restart would lose
  the in-flight prompts; the run stops and says how to resume it;
- an engine is restarted by `RestartPolicy` (launch/supervision.py): not after a failure at
  start nor a fatal error, at most `max_restarts` times after a crash mid-run. A restarted
  engine loads the initial weights; the trainer's next push (every version is a full push)
  brings it to the current version, and what it generates before that is dropped as stale.

`stop_units` is the graceful stop of both: a stop request (SIGTERM to the role processes)
to every live unit, then a kill for those still alive after `grace_s`.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass
from typing import Protocol

from miles.core.logging import get_logger
from miles.launch.supervision import CrashReport, RestartPolicy

log = get_logger("miles.launch")


class Unit(Protocol):
    """One supervised role: a local process or a Slurm step."""

    @property
    def role(self) -> str:  # engine, eval_engine, rollout, trainer, head (a Slurm step derives it)
        ...

    index: int  # engine index or trainer rank (0 for a Slurm step, which holds every task)
    restarts: int
    env: dict[str, str]  # the environment of its next start

    def start(self) -> None: ...

    def poll(self) -> int | None:
        """The exit code once it has ended, else None."""
        ...

    def served(self) -> bool:
        """Whether it became ready at least once (its ready file): a later exit is not a failure at start."""
        ...

    def crash(self) -> CrashReport:
        """Why its current incarnation ended, from its log(s)."""
        ...

    def log_hint(self) -> str: ...

    def request_stop(self) -> None:
        """Ask it to drain and exit (SIGTERM to its role processes)."""
        ...

    def kill(self) -> None: ...


@dataclass
class Supervisor:
    units: list[Unit]
    policy: RestartPolicy
    resume_hint: str  # the command that continues this run from its last checkpoint
    stop: asyncio.Event  # set by SIGINT/SIGTERM: the run ends with 130
    poll_s: float = 0.2

    async def run(self) -> int:
        """Watch the units until the run ends; its exit code (see the module doc)."""
        while not self.stop.is_set():
            for u in self.units:
                code = u.poll()
                if code is None:
                    continue
                rc = self._on_exit(u, code)
                if rc is not None:
                    return rc
            try:
                await asyncio.wait_for(self.stop.wait(), self.poll_s)
            except TimeoutError:
                pass
        log.info("run_interrupted")  # not a fault: the launcher prints where the run can resume from
        return 130

    def _on_exit(self, u: Unit, code: int) -> int | None:
        """The run's exit code if this exit ends it, else None (the unit was restarted or is done)."""
        if u.role == "trainer":
            if code != 0:
                log.error("trainer_exited", rank=u.index, code=code, cause=u.crash().reason,
                          hint=f"see {u.log_hint()}; the last checkpoint is kept")
                return code
            if all(t.poll() is not None for t in self.units if t.role == "trainer"):
                return 0
            return None
        report = u.crash()
        served = u.served()
        if u.role == "head":
            log.error("head_exited", code=code, cause=report.reason, log=u.log_hint(),
                      hint="the directory is gone: no role can reach another")
            return 1
        if u.role == "rollout":
            # The buffer lives in the rollout process: restarting it empty would lose the
            # in-flight prompts, so stop and let the user resume from the last checkpoint.
            log.error("rollout_crashed" if served else "role_failed_at_start", role=u.role, code=code,
                      cause=report.reason, log=u.log_hint(),
                      hint=f"resume with: {self.resume_hint}" if served else
                      "it would fail again: fix the cause and start again")
            return 1
        decision = self.policy.decide(served=served, fatal=report.fatal, restarts=u.restarts)
        if decision.action == "stop":
            log.error(decision.why, role=u.role, index=u.index, code=code, cause=report.reason,
                      log=u.log_hint(), restarts=u.restarts)
            return 1
        u.restarts += 1
        log.warning(decision.why, role=u.role, index=u.index, code=code, restart=u.restarts,
                    max_restarts=self.policy.max_restarts, cause=report.reason)
        u.env = {**u.env, "MILES_RESUME": ""}  # a checkpoint is for the first start only
        u.start()
        return None


def die_with_parent() -> None:
    """In a unit's process before exec: get SIGTERM when the supervisor dies, even by SIGKILL (no orphans)."""
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


async def stop_units(units: list[Unit], grace_s: float, kill_wait_s: float = 5.0) -> None:
    """Ask every live unit to stop, wait up to `grace_s`, kill the rest (and wait for them)."""
    live = [u for u in units if u.poll() is None]
    for u in live:
        u.request_stop()
    deadline = time.monotonic() + grace_s
    while any(u.poll() is None for u in live) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    late = [u for u in live if u.poll() is None]
    for u in late:
        log.warning("role_killed", role=u.role, index=u.index, grace_s=grace_s)
        u.kill()
    deadline = time.monotonic() + kill_wait_s
    while any(u.poll() is None for u in late) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
