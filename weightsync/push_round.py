"""One version's push, the skeleton both weight-sync coordinators run: pause -> open -> send ->
commit -> resume, timed into a `SyncReport`.

The coordinator supplies the middle (open the channel, move the buckets; the sharded one wraps
each step in a collective over the trainer ranks); `PushRound` keeps what is the same in both:
the live and dead engines, each phase's time, abort of the version on the engines when any step
fails, and the resume that runs whatever happened.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from miles.core.errors import ActorDeadError, MilesError, PlanMissing, Stopping, SyncError
from miles.core.logging import get_logger

log = get_logger("miles.sync")
Call = Callable[[str], Awaitable[Any]]  # one step on one engine, by name


@dataclass
class SyncReport:
    version: int
    transport: str = "zmq"
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    committed: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    verified: bool | None = None
    declined: list[str] = field(default_factory=list)  # engines that declined the flat plan (tensors went)
    # phases of `seconds` (pause -> stage every bucket -> commit -> resume), for perf/* metrics
    pause_s: float = 0.0
    transfer_s: float = 0.0
    commit_s: float = 0.0
    resume_s: float = 0.0
    full_bytes: int = 0  # sharded syncs: what the version is in full; `bytes` less with deltas

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


async def each(step: str, names: list[str], call: Call, dead: list[str]) -> list[Any]:
    """`call` on every engine at once: a dead one joins `dead` (and answers None), and so does
    one that restarted since it took the flat plan (`PlanMissing`: the trainer's watcher catches
    it up with a full copy); any other failure raises SyncError naming the step and the engine."""

    async def one(name: str) -> Any:
        try:
            return await call(name)
        except (ActorDeadError, PlanMissing):
            if name not in dead:  # several buckets in flight can each see the same death
                dead.append(name)
            return None
        except MilesError as exc:
            raise SyncError(f"{step} failed on engine {name!r}: {type(exc).__name__}: {exc}") from exc

    return await asyncio.gather(*(one(n) for n in names))


def _stopping(exc: SyncError) -> bool:
    """A step failed only because this process is shutting down (its sockets are closed)."""
    return isinstance(exc.__cause__, Stopping)


class PauseLink(Protocol):
    """The engine calls a round makes itself (a part of `SyncLink`)."""

    async def pause(self, engine: str, mode: str) -> None: ...
    async def resume(self, engine: str) -> None: ...
    async def commit(self, engine: str, version: int) -> None: ...
    async def abort(self, engine: str, version: int) -> None: ...


class PushRound:
    """Version `version` to `engines` over `link`; `rep` is filled as the phases pass."""

    def __init__(self, link: PauseLink, version: int, tag: str, engines: list[str]) -> None:
        self.link, self.version = link, version
        self.rep = SyncReport(version, tag)
        self.dead = self.rep.dead  # engines found dead so far (every step appends here)
        self.live = list(engines)
        self.paused = False
        self.t0 = time.perf_counter()
        self._t_staged = self.t0

    def alive(self) -> list[str]:
        """The engines still live (the dead ones dropped)."""
        self.live = [n for n in self.live if n not in self.dead]
        return self.live

    async def pause(self, mode: str) -> None:
        """Pause the live engines (`mode` "none": nothing). Marked paused first, so a pause that
        fails on one engine still resumes the others."""
        if mode == "none":
            return
        self.paused = True
        await each("pause", self.alive(), lambda n: self.link.pause(n, mode), self.dead)

    def mark_paused(self) -> None:
        self.rep.pause_s = time.perf_counter() - self.t0

    def mark_staged(self) -> None:
        """Every bucket is on every live engine."""
        self._t_staged = time.perf_counter()
        self.rep.transfer_s = self._t_staged - self.t0 - self.rep.pause_s

    async def commit(self) -> None:
        """Ask the live engines to commit the version."""
        await each(f"commit v{self.version}", self.alive(), lambda n: self.link.commit(n, self.version),
                   self.dead)

    def mark_committed(self) -> list[str]:
        """The engines that committed (the live ones now); returns them."""
        self.rep.committed = list(self.alive())
        self.rep.commit_s = time.perf_counter() - self._t_staged
        return self.rep.committed

    async def abort(self) -> None:
        """Drop the version on the live engines (an error here is logged: the push's own failure
        is what the caller sees)."""
        try:
            await each(f"abort v{self.version}", self.alive(), lambda n: self.link.abort(n, self.version), [])
        except SyncError as exc:
            if not _stopping(exc):  # at shutdown the engines stop too: nothing is left to abort
                log.error("abort_version_failed", version=self.version, error=str(exc))

    async def run(self, body: Callable[[], Awaitable[None]],
                  on_failure: Callable[[BaseException], Awaitable[None]],
                  forget: Callable[[], None]) -> SyncReport:
        """`body` (the phases up to the commit); on any failure `forget` (the channel is rebuilt
        on the next push), then `on_failure(exc)` (abort; it may raise a clearer error), then the
        failure goes on. Resumes the paused engines in every case. With dead engines `forget`
        too, and a warning."""
        try:
            await body()
        except BaseException as exc:
            forget()
            await on_failure(exc)
            raise
        finally:
            t_resume = time.perf_counter()
            if self.paused:
                try:
                    await each("resume", self.alive(), self.link.resume, self.dead)
                except SyncError as exc:
                    if _stopping(exc):  # Ctrl-C / SIGTERM mid-push: the engines stop as well
                        log.info("resume_skipped_stopping", version=self.version)
                    else:
                        log.error("resume_failed", error=str(exc))
            self.rep.resume_s = time.perf_counter() - t_resume
        self.rep.seconds = time.perf_counter() - self.t0
        if self.dead:
            forget()
            log.warning("sync_engines_dead", version=self.version, dead=self.dead)
        return self.rep
