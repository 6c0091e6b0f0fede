"""How the trainer actor's loop ending is reported: a rollout that answers `Stopping` while the run
stops (Ctrl-C reaches every role at once) ends the trainer with an info line, not an error on the
console; anything else is logged as its failure. Either way the loop did not reach its end."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from miles.actors.trainer import TrainerActor
from miles.core.errors import KNOWN_ERRORS, MilesError

pytestmark = pytest.mark.timeout(30)


async def loop_ending_with(exc: BaseException) -> tuple[TrainerActor, list[dict]]:
    actor = TrainerActor.__new__(TrainerActor)  # only what _finished touches: no model, no sockets
    actor.error, actor.done = None, asyncio.Event()

    async def loop() -> None:
        raise exc

    task = asyncio.create_task(loop())
    await asyncio.gather(task, return_exceptions=True)
    with capture_logs() as logs:
        actor._finished(task)
    assert actor.done.is_set()
    return actor, logs


async def test_a_stopping_rollout_is_not_an_error_on_the_console() -> None:
    # as it arrives over the wire: the remote type name mapped back to the class
    stopping = KNOWN_ERRORS["Stopping"]("the rollout is stopping: the batch for trainer version 4 ends with 0 of 8 groups")
    actor, logs = await loop_ending_with(stopping)
    assert actor.error is stopping  # the role still exits 1: the run did not reach its end
    assert [e["event"] for e in logs] == ["trainer_stopped"] and logs[0]["log_level"] == "info"


async def test_any_other_error_fails_the_trainer() -> None:
    actor, logs = await loop_ending_with(MilesError("boom"))
    assert isinstance(actor.error, MilesError)
    assert [(e["event"], e["log_level"]) for e in logs] == [("trainer_failed", "error")]
