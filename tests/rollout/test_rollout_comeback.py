"""rollout/routing/comeback.py: a down engine is taken back once its health reply says it serves
(at the run's weight version where one is asked for); a reply this process cannot decode is
said once as a warning, while a down engine's failing asks are retried without a word."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from miles.core.errors import ActorDeadError
from miles.engines.health import HealthReply
from miles.rollout.routing.comeback import serving_again
from miles.transport.codec import REPLY, decode, encode

pytestmark = pytest.mark.timeout(30)


def reply(version: int, ok: bool = True) -> HealthReply:
    return HealthReply(version=version, ok=ok, paused=False, running=0, queued=0)


def undecodable() -> HealthReply:
    """A reply whose version is not an int, through the real wire codec: it raises ProtocolError."""
    bad = HealthReply(version="7", ok=True, paused=False, running=0, queued=0)  # type: ignore[arg-type]
    env = decode(encode(REPLY, 1, "", bad))
    return env.body  # not reached: decode refuses the record


async def test_waits_for_ok_at_the_runs_version_read_at_each_reply() -> None:
    answers = [ActorDeadError("e0 is dead"), reply(0, ok=False), reply(0), reply(3), reply(5)]
    run_version = [4]
    asked: list[str] = []

    async def health(engine: str) -> HealthReply:
        asked.append(engine)
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        if a.version == 3:
            run_version[0] = 5  # a step landed while the engine was down
        return a

    with capture_logs() as logs:
        await asyncio.wait_for(serving_again("e0", health, lambda: run_version[0], poll_s=0.001), 10)
    assert asked == ["e0"] * 5 and answers == []  # ok at v0 and v3 were too old; v5 is the run's
    assert [e for e in logs if e["log_level"] == "warning"] == []  # a down engine's failures say nothing


async def test_an_undecodable_reply_is_warned_once_and_the_wait_goes_on() -> None:
    answers = ["bad", "bad", "bad", "ok"]

    async def health(engine: str) -> HealthReply:
        return undecodable() if answers.pop(0) == "bad" else reply(0)

    with capture_logs() as logs:
        await asyncio.wait_for(serving_again("judge-0", health, poll_s=0.001), 10)
    warned = [e for e in logs if e["event"] == "engine_health_unreadable"]
    assert len(warned) == 1 and warned[0]["engine"] == "judge-0" and "version" in warned[0]["error"]
    assert answers == []
