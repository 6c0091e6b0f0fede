"""Liveness of a host: the event-loop lag monitor, and heartbeats (from a thread, or straight
into a co-hosted directory).

Heartbeats come from a thread with its own socket, so a loop busy for a few seconds
(imports, a long GC, a blocking call) is not mistaken for a dead process; a loop that
has not ticked for `transport.loop_stall_timeout_s` stops them, and the directory then
declares the host dead. A host declared dead that is in fact alive registers its actors
again under a new incarnation (same names, same address): that is `Host._rejoin`, since it
rewrites the host's own identity and address book.

The monitor and the beats share a few of the host's fields; `HostPulse` names them, so this
module needs nothing of host.py (which starts both) and the two do not import each other.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import zmq

from miles.actors.runtime.messages import DIRECTORY_NAME, Heartbeat
from miles.core.logging import get_logger
from miles.core.schema.transport import TransportConfig
from miles.transport import codec
from miles.transport.curve import make_curve_client
from miles.transport.faults import FaultHook
from miles.transport.sockets import apply_options

log = get_logger("miles.host")


class HostPulse(Protocol):
    """The host's liveness fields: the lag monitor writes them on the loop, the heartbeat
    thread reads them (plain attribute reads, without the loop)."""

    cfg: TransportConfig
    host_id: str  # changes when the host rejoins: each beat reads it afresh
    faults: FaultHook | None
    beat_stop: threading.Event  # set when the host stops: the thread exits
    last_tick: float  # time.monotonic() of the loop's last sign of life
    loop_lag_ms: float  # smoothed lag, sent with each beat
    max_loop_lag_ms: float
    starting: bool  # the process is setting up its actors (serve()): a stall then is expected
    serving_since: float  # when that set-up ended

    @property
    def actors(self) -> Mapping[str, object]: ...


@runtime_checkable
class BeatSink(Protocol):
    """The directory actor as its own host's beats reach it (actors/runtime/directory.py)."""

    def beat(self, msg: Heartbeat) -> None: ...


async def lag_monitor(host: HostPulse, interval: float = 0.1) -> None:
    """Tick every `interval`: record the loop's last sign of life and how late the tick was."""
    while True:
        t0 = time.monotonic()
        await asyncio.sleep(interval)
        host.last_tick = time.monotonic()
        lag = max(0.0, (host.last_tick - t0 - interval) * 1e3)
        host.loop_lag_ms = 0.8 * host.loop_lag_ms + 0.2 * lag
        host.max_loop_lag_ms = max(host.max_loop_lag_ms, lag)
        if lag > 500:
            if host.starting or t0 < host.serving_since:
                log.debug("event_loop_lag_at_start", lag_ms=round(lag, 1))
            else:
                log.warning("event_loop_lag", lag_ms=round(lag, 1))


def heartbeat_thread(host: HostPulse, address: str) -> None:
    """Beat from a thread with its own socket, while the loop has ticked within the stall bound."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    apply_options(sock, hwm=4, linger_ms=0)  # a few beats queue at most; older ones are moot
    try:
        if host.cfg.curve_client_key:
            make_curve_client(sock, host.cfg.curve_client_key, host.cfg.curve_public_key)
        sock.connect(address)
        warned = False
        while not host.beat_stop.wait(host.cfg.heartbeat_interval_s):
            stalled_s = time.monotonic() - host.last_tick
            if stalled_s > host.cfg.loop_stall_timeout_s:
                if not warned:  # silence now lets the directory declare this host dead
                    log.error("event_loop_stalled", stalled_s=round(stalled_s, 1), host=host.host_id)
                    warned = True
                continue
            warned = False
            try:
                names = [n for n in list(host.actors) if n != DIRECTORY_NAME]
            except RuntimeError:  # the dict changed under us: beat next time
                continue
            if not names:
                continue
            beat = Heartbeat(host.host_id, names, max(host.loop_lag_ms, stalled_s * 1e3))
            if host.faults is not None and host.faults.draw(codec.TELL, "rt.Heartbeat", may_delay=False) is None:
                continue  # injected loss (no delays here: a late beat is the next beat)
            try:
                sock.send_multipart(codec.encode(codec.TELL, None, DIRECTORY_NAME, beat, None, host.host_id),
                                    zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass  # the directory is not reading: its own stall, see Directory._watch
    except Exception as exc:  # noqa: BLE001 - a dead heartbeat thread must say why
        log.error("heartbeat_thread_failed", error=f"{type(exc).__name__}: {exc}")
    finally:
        sock.close(0)


async def directory_heartbeats(host: HostPulse) -> None:
    """The directory's own host: beats straight into the co-hosted directory, no socket."""
    while True:
        await asyncio.sleep(host.cfg.heartbeat_interval_s)
        directory = host.actors.get(DIRECTORY_NAME)
        if isinstance(directory, BeatSink):
            names = [n for n in host.actors if n != DIRECTORY_NAME]
            directory.beat(Heartbeat(host.host_id, names, host.loop_lag_ms))
