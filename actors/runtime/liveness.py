"""Liveness of a host: heartbeats from a thread, and rejoining after a wrong death notice.

Heartbeats come from a thread with its own socket, so a loop busy for a few seconds
(imports, a long GC, a blocking call) is not mistaken for a dead process; a loop that
has not ticked for `transport.loop_stall_timeout_s` stops them, and the directory then
declares the host dead. A host declared dead that is in fact alive registers its actors
again under a new incarnation (same names, same address).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import zmq

from miles.actors.runtime.messages import DeathNotice, Heartbeat, Location, Register
from miles.core.errors import MilesError
from miles.core.logging import get_logger
from miles.transport import codec
from miles.transport.curve import make_curve_client
from miles.transport.sockets import apply_options

if TYPE_CHECKING:
    from miles.actors.runtime.host import Host

log = get_logger("miles.host")
DIRECTORY_NAME = "directory"  # the directory actor's name (re-exported by host.py)


def heartbeat_thread(host: Host, address: str) -> None:
    """Beat from a thread with its own socket, while the loop has ticked within the stall bound."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    apply_options(sock, hwm=4, linger_ms=0)  # a few beats queue at most; older ones are moot
    try:
        if host.cfg.curve_client_key:
            make_curve_client(sock, host.cfg.curve_client_key, host.cfg.curve_public_key)
        sock.connect(address)
        warned = False
        while not host._beat_stop.wait(host.cfg.heartbeat_interval_s):
            stalled_s = time.monotonic() - host._last_tick
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


async def rejoin(host: Host, notice: DeathNotice) -> None:
    """Register every actor again under a new incarnation: same names, same address.

    Peers failed their asks to the old incarnation when they heard of its death; its
    late replies find no pending request and are refused (`stale_replies`).
    """
    old = host.host_id
    host._old_ids.add(old)
    host.incarnation += 1
    host.host_id = f"{host._base_id}#{host.incarnation}"
    log.warning("host_rejoining", old_host=old, host=host.host_id, reason=notice.reason)
    for name in list(host.actors):
        if name == DIRECTORY_NAME:
            continue
        loc = Location(name, host.address, host.pub_address, host.host_id)
        host._locations[name] = loc
        try:
            await host._directory_ask(Register(name, host.address, host.pub_address, host.host_id))
        except MilesError as exc:
            log.error("rejoin_failed", actor=name, error=str(exc))
            return
    host._dead_hosts.add(old)
    log.warning("host_rejoined", host=host.host_id, actors=[n for n in host.actors if n != DIRECTORY_NAME])

