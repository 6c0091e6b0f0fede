"""The torch engine's decode warm-up: capture the decode graphs, and compile them in the background.

With engine.compile_decode the capture compiles first (50-110 s on an H200 for the bench
models); with engine.compile_background the engine captures uncompiled graphs at once (seconds),
serves with them, and a worker thread compiles aside; the compiled graphs are swapped in between
two scheduler hops, under the engine's step lock, so no decode step is in flight at the swap.

Plain class, composed by `TorchEngine`, which hands it its stepper, its step lock and a way to
ask whether it was closed (a compile that ends after `close` is dropped).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from miles.core.logging import get_logger
from miles.engines.stepper import Stepper

log = get_logger("miles.engine")


class DecodeWarmUp:
    """Warm-up and (engine.compile_background) the background compile of one engine's decode graphs."""

    def __init__(self, stepper: Stepper, lock: asyncio.Lock, background: bool, closed: Callable[[], bool]) -> None:
        self.stepper = stepper
        self._lock = lock  # the engine's step lock: no capture or swap overlaps a decode step
        self._background = background
        self._closed = closed
        self._task: asyncio.Task[None] | None = None

    async def warm_up(self) -> None:
        """Capture the decode graphs now, compiled or, in the background mode, uncompiled at once
        while the compile runs in a worker thread and is swapped in when ready (`done`)."""
        g = self.stepper.graphs
        if g is None:
            return
        t0 = time.monotonic()
        background = g.compiled and self._background
        if background:
            g.compiled = False  # serve with uncompiled graphs until the compile is ready
        async with self._lock:  # background: every batch bucket, uncompiled (seconds), as no capture may overlap it
            await asyncio.to_thread(self.stepper.warm_up, background)
        log.info("engine_warmed_up", seconds=round(time.monotonic() - t0, 1), compiled=g.compiled,
                 graphs_failed=g.failed, compiling_in_background=background and not g.failed)
        if background and not g.failed:
            log.info("decode_compile_started", note="serving with uncompiled decode graphs until it is ready")
            self._task = asyncio.get_running_loop().create_task(self._compile(), name="decode-compile")

    async def _compile(self) -> None:
        t0 = time.monotonic()
        ok = await asyncio.to_thread(self.stepper.compile_aside)
        if not ok or self._closed():
            log.warning("decode_compile_skipped", seconds=round(time.monotonic() - t0, 1),
                        reason="engine closed" if self._closed() else "the compile failed: serving uncompiled graphs")
            return
        t1 = time.monotonic()
        async with self._lock:  # between hops: no decode step is in flight
            if self._closed():
                return
            await asyncio.to_thread(self.stepper.use_compiled)
        g = self.stepper.graphs
        log.info("decode_compile_ready", compile_s=round(t1 - t0, 1), swap_s=round(time.monotonic() - t1, 1),
                 compiled=g is not None and g.compiled)

    async def done(self) -> bool:
        """Wait for a background decode compile (if one runs); whether decode is compiled now."""
        if self._task is not None:
            await asyncio.shield(self._task)
        g = self.stepper.graphs
        return g is not None and g.compiled and not g.failed
