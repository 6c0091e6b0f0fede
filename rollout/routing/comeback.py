"""Waiting for a down engine to serve again: the rollout's policy engines and its judges alike.

A down engine is asked for its health every `UP_POLL_S` until the reply says it serves. Its
failing asks (dead, restarting, its server still loading) are what a down engine does and are
retried without a word. A reply this process cannot read (`ProtocolError`: a record it has not
registered, another miles version on the other side) is not: the engine may be up, and the wait
would go on silently for ever, so it is logged once as a warning with the decoder's reason.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from miles.core.errors import MilesError, ProtocolError
from miles.core.logging import get_logger

log = get_logger("miles.rollout")

UP_POLL_S = 0.5  # how often a down engine is asked whether it is back


class Serving(Protocol):
    """What the wait reads of an engine's health reply (engines/health.py `HealthReply`)."""

    @property
    def ok(self) -> bool: ...

    @property
    def version(self) -> int: ...


# (engine name) -> its Health reply; raises while it is down
HealthCall = Callable[[str], Awaitable[Serving]]


async def serving_again(engine: str, health: HealthCall, min_version: Callable[[], int] | None = None,
                        poll_s: float = UP_POLL_S) -> None:
    """Return once `engine`'s health reply says ok, at weight version `min_version()` or later
    when given (read at each reply: the run's version moves while the engine is down)."""
    warned = False
    while True:
        await asyncio.sleep(poll_s)
        try:
            h = await health(engine)
        except ProtocolError as exc:
            if not warned:
                log.warning("engine_health_unreadable", engine=engine, error=str(exc),
                            note="its health reply cannot be decoded here; it stays out of the routing")
                warned = True
            continue
        except MilesError:
            continue
        if h.ok and (min_version is None or h.version >= min_version()):
            return
