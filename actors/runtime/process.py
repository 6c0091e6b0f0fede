"""Process entry: run a host with its actors on uvloop until SIGTERM/SIGINT, then drain and exit 0."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop

from miles.actors.runtime.directory import Directory
from miles.actors.runtime.host import DIRECTORY_NAME, Host
from miles.core.files import atomic_write_text
from miles.core.logging import get_logger
from miles.core.schema.transport import TransportConfig

log = get_logger("miles.process")
DIRECTORY_ENV = "MILES_DIRECTORY"

Setup = Callable[[Host], Awaitable[None]]


def dump_tasks() -> None:
    """SIGUSR1: write every asyncio task and where it waits to stderr (for a hung process)."""
    import sys
    import traceback

    for t in asyncio.all_tasks():
        frames = t.get_stack(limit=8)
        where = " <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in reversed(frames))
        print(f"[task] {t.get_name()}: {where}", file=sys.stderr, flush=True)
    traceback.print_stack(file=sys.stderr)


async def serve(setup: Setup, cfg: TransportConfig | None = None, directory: str | None = None,
                run_directory: bool = False, ready_file: str = "",
                stop_event: asyncio.Event | None = None) -> int:
    """Start a host (optionally running the directory), call `setup(host)`, serve until a signal."""
    cfg = cfg or TransportConfig()
    if not run_directory and directory is None:
        directory = os.environ.get(DIRECTORY_ENV)
        if not directory:
            raise SystemExit(f"no directory address: pass one or set {DIRECTORY_ENV}")
    host = Host(cfg, None if run_directory else directory)
    await host.start()
    if run_directory:
        await host.add(Directory(cfg.heartbeat_timeout_s, cfg.heartbeat_interval_s), DIRECTORY_NAME)
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks)
    host.starting = True  # the set-up's loop stalls (imports, loads) are no event-loop lag to warn of
    # A stop asked for during the set-up ends it at once: when one role fails at start the launcher
    # stops the others, and one waiting for its peers (engine.ready_wait_s) would otherwise hold
    # out until the launcher's grace ran out and it was killed.
    set_up = asyncio.ensure_future(setup(host))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({set_up, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        host.starting, host.serving_since = False, time.monotonic()
    if not set_up.done():
        set_up.cancel()
        await asyncio.wait({set_up})
        log.info("host_stopping_in_setup")
        await host.stop()
        return 0
    stopping.cancel()
    set_up.result()  # a set-up that failed fails the process, as before
    if ready_file:
        # Written last, atomically, so a parent polling for it sees a fully started host.
        atomic_write_text(ready_file, host.address)
    log.info("host_ready", address=host.address, actors=list(host.actors))
    await stop.wait()
    log.info("host_stopping", max_loop_lag_ms=round(host.max_loop_lag_ms, 2))
    await host.stop()
    return 0


def run(setup: Setup, **kwargs: Any) -> int:
    """Blocking entry point for a process: uvloop + `serve`."""
    return uvloop.run(serve(setup, **kwargs))
