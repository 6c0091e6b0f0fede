"""PushRound, the push skeleton both coordinators run, driven over an in-memory engine link."""

from __future__ import annotations

import pytest

from miles.core.errors import ActorDeadError, EngineError, SyncError
from miles.weightsync.push_round import PushRound

pytestmark = pytest.mark.timeout(30)


class Link:
    """Engines by name: records every call; `fail` maps (call, engine) to the error it raises."""

    def __init__(self, fail: dict[tuple[str, str], Exception] | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail = fail or {}

    async def _call(self, what: str, engine: str) -> None:
        self.calls.append((what, engine))
        if (what, engine) in self.fail:
            raise self.fail[(what, engine)]

    async def pause(self, engine: str, mode: str) -> None:
        await self._call("pause", engine)

    async def resume(self, engine: str) -> None:
        await self._call("resume", engine)

    async def commit(self, engine: str, version: int) -> None:
        await self._call("commit", engine)

    async def abort(self, engine: str, version: int) -> None:
        await self._call("abort", engine)


async def test_a_round_pauses_commits_resumes_and_times_each_phase() -> None:
    link = Link(fail={("commit", "b"): ActorDeadError("b is gone")})
    rnd = PushRound(link, 3, "zmq", ["a", "b", "c"])
    forgot = []

    async def body() -> None:
        await rnd.pause("in_place")
        rnd.mark_paused()
        rnd.mark_staged()
        await rnd.commit()
        rnd.mark_committed()

    async def on_failure(exc: BaseException) -> None:
        raise AssertionError("no failure expected")

    rep = await rnd.run(body, on_failure, lambda: forgot.append(True))
    assert rep.committed == ["a", "c"] and rep.dead == ["b"]
    assert ("resume", "a") in link.calls and ("resume", "b") not in link.calls
    assert forgot == [True]  # a dead engine: the channel is rebuilt next push
    assert rep.seconds >= rep.pause_s >= 0 and rep.transfer_s >= 0 and rep.commit_s >= 0


async def test_a_failing_pause_still_resumes_the_others_and_aborts() -> None:
    link = Link(fail={("pause", "b"): EngineError("busy")})
    rnd = PushRound(link, 5, "zmq", ["a", "b"])
    seen: list[BaseException] = []

    async def body() -> None:
        await rnd.pause("in_place")

    async def on_failure(exc: BaseException) -> None:
        seen.append(exc)
        await rnd.abort()

    with pytest.raises(SyncError, match="pause failed on engine 'b'"):
        await rnd.run(body, on_failure, lambda: None)
    assert len(seen) == 1
    assert {("abort", "a"), ("abort", "b"), ("resume", "a"), ("resume", "b")} <= set(link.calls)


async def test_no_pause_mode_means_no_resume() -> None:
    link = Link()
    rnd = PushRound(link, 1, "zmq", ["a"])

    async def body() -> None:
        await rnd.pause("none")
        await rnd.commit()
        rnd.mark_committed()

    async def on_failure(exc: BaseException) -> None:
        raise AssertionError(exc)

    rep = await rnd.run(body, on_failure, lambda: None)
    assert link.calls == [("commit", "a")] and rep.committed == ["a"]


async def test_a_push_cut_by_this_process_stopping_logs_no_error() -> None:
    """Ctrl-C mid-push: the trainer's loop is cancelled and its host has closed its sockets, so
    resume and abort cannot be sent. That is shutdown, not a failed sync: logged at info."""
    import asyncio

    import structlog

    from miles.core.errors import Stopping

    closed = Stopping("send Resume to 'a': the socket is closed; this process is stopping")
    link = Link(fail={("resume", "a"): closed, ("abort", "a"): closed})
    rnd = PushRound(link, 4, "zmq", ["a"])

    async def body() -> None:
        await rnd.pause("in_place")
        raise asyncio.CancelledError  # the loop's task cancelled by the actor's stop

    async def on_failure(exc: BaseException) -> None:
        await rnd.abort()

    with structlog.testing.capture_logs() as logs, pytest.raises(asyncio.CancelledError):
        await rnd.run(body, on_failure, lambda: None)
    assert ("resume", "a") in link.calls and ("abort", "a") in link.calls
    assert not [e for e in logs if e["log_level"] == "error"], logs
    assert [e["event"] for e in logs] == ["resume_skipped_stopping"]
    # any other failure of the resume is still an error
    link = Link(fail={("resume", "a"): EngineError("engine fault")})
    rnd = PushRound(link, 5, "zmq", ["a"])

    async def paused() -> None:
        await rnd.pause("in_place")

    with structlog.testing.capture_logs() as logs:
        await rnd.run(paused, on_failure, lambda: None)
    assert [(e["event"], e["log_level"]) for e in logs] == [("resume_failed", "error")]
