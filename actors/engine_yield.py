"""Engines step aside while the trainer computes (`trainer.pause_engines`).

On one GPU shared by engine and trainer processes, the two time-slice the device: a train
step that runs beside a full decode batch stretches to several times its length
(docs/orchestration.md). Pausing the engines in place for the step's length (their requests
and KV stay, decoding continues where it stopped) gives the step the whole GPU; fully_async
still gains, because between steps the engine decodes a full continuous batch instead of a
sync batch's shrinking tail. A dead or slow engine only costs a logged warning: training
never waits on it beyond `timeout_s`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from miles.actors.messages import Pause, Resume
from miles.core.logging import get_logger

log = get_logger("miles.trainer")

Ask = Callable[[str, Any, float], Awaitable[Any]]


class EngineYield:
    """`async with yielder.during("train"):` pauses every engine in place, then resumes them."""

    def __init__(self, ask: Ask, engines: list[str], enabled: bool, timeout_s: float = 30.0) -> None:
        self.ask, self.engines, self.enabled, self.timeout_s = ask, engines, enabled, timeout_s
        self.failures = 0

    async def _all(self, msg: Any, what: str) -> None:
        done = await asyncio.gather(*(self.ask(e, msg, self.timeout_s) for e in self.engines),
                                    return_exceptions=True)
        for name, r in zip(self.engines, done, strict=True):
            if isinstance(r, BaseException):
                if not isinstance(r, Exception):
                    raise r
                self.failures += 1
                log.warning("engine_yield_failed", engine=name, action=what, error=f"{type(r).__name__}: {r}")

    @asynccontextmanager
    async def during(self, phase: str) -> AsyncIterator[None]:
        if not self.enabled or not self.engines:
            yield
            return
        await self._all(Pause("in_place"), f"pause for {phase}")
        try:
            yield
        finally:
            await self._all(Resume(), f"resume after {phase}")
