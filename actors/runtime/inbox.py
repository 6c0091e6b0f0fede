"""A host's inbound half: requests read off its ROUTER socket, routed to the target actor's
mailbox for the message's type, run by the mailbox's workers under their deadline, answered.

A malformed request, an unknown actor or a type with no handler gets a `ProtocolError` reply
(an ask) and is counted in `protocol_errors`. A full mailbox blocks reading (backpressure) or,
for a "refuse" handler, answers `MailboxFull` (an ask) or drops the tell, counted in `refused`.
A plain-function handler with an idle mailbox runs inline, in order. A handler's exception goes
back to the asker; a tell's is logged.

Plain class, composed by `Host` (host.py), which owns the socket and the actors.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from miles.actors.runtime.actor import Mailbox
from miles.core.errors import MailboxFull, MilesError, PeerTimeout, ProtocolError
from miles.core.logging import get_logger
from miles.core.schema.transport import TransportConfig
from miles.transport import codec
from miles.transport.faults import FaultHook
from miles.transport.schema import spec_for_class
from miles.transport.sockets import QueuedLoopSocket

log = get_logger("miles.host")


class Inbox:
    """The mailboxes of one host's actors (actor name -> wire type name -> mailbox) and their dispatch."""

    def __init__(self, cfg: TransportConfig, faults: FaultHook | None, host_id: Callable[[], str]) -> None:
        self.cfg = cfg
        self.faults = faults
        self._host_id = host_id  # the host's id changes when it rejoins (host.py `_rejoin`)
        self.mailboxes: dict[str, dict[str, Mailbox]] = {}
        self.protocol_errors = 0
        self.refused = 0  # tells refused by a full "refuse" mailbox
        self._router: QueuedLoopSocket | None = None

    @property
    def router(self) -> QueuedLoopSocket:
        if self._router is None:
            raise MilesError("the host's inbox is not serving yet (Host.start runs it)")
        return self._router

    async def serve(self, router: QueuedLoopSocket) -> None:
        """Read and dispatch requests from `router` until cancelled."""
        self._router = router
        while True:
            for frames in await router.recv_batch():
                await self._on_request(frames)
            router.done()

    def count_protocol_error(self, where: str, exc: ProtocolError) -> None:
        self.protocol_errors += 1
        n = self.protocol_errors
        if n <= 10 or n % 1000 == 0:
            log.warning("protocol_error", where=where, error=str(exc), count=n)

    async def _on_request(self, frames: list[Any]) -> None:
        ident, body = frames[0], frames[1:]
        try:
            env = codec.decode(body, self.cfg.max_frame_bytes)
        except ProtocolError as exc:
            self.count_protocol_error("request", exc)
            msg_id, target = codec.peek_reply_route(body)
            await self.router.send([ident, *codec.encode_error(msg_id, target, exc)])
            return
        if env.kind == codec.BATCH:
            for item in env.body:
                single = codec.Envelope(codec.TELL, None, env.target, "", 0, None, item, env.sender)
                await self._dispatch(ident, single, type(item))
        elif env.kind in (codec.ASK, codec.TELL):
            await self._dispatch(ident, env, type(env.body))
        else:
            self.count_protocol_error("request", ProtocolError(f"unexpected kind {env.kind}"))

    async def _dispatch(self, ident: Any, env: codec.Envelope, cls: type) -> None:
        boxes = self.mailboxes.get(env.target)
        spec = spec_for_class(cls)
        box = boxes.get(spec.name) if boxes is not None and spec is not None else None
        if box is None:
            what = (f"no actor named {env.target!r} on host {self._host_id()}" if boxes is None
                    else f"actor {env.target!r} has no handler for {cls.__name__}")
            exc = ProtocolError(what)
            self.count_protocol_error("request", exc)
            if env.kind == codec.ASK:
                await self.router.send([ident, *codec.encode_error(env.msg_id, env.target, exc)])
            return
        deadline = time.monotonic() + env.deadline_s if env.deadline_s is not None else None
        if box.sync and not box.busy and box.queue.empty():
            # Fast path: a plain-function handler with an idle mailbox runs inline, in order,
            # saving a task switch per message.
            box.busy += 1
            try:
                await self._run(env.target, box, ident, env, deadline)
            finally:
                box.busy -= 1
            return
        item = (ident, env, deadline)
        try:
            box.queue.put_nowait(item)
        except asyncio.QueueFull:
            if box.refuse:
                await self._refuse(ident, env, cls)
                return
            await box.queue.put(item)  # backpressure: stop reading until there is room

    async def _refuse(self, ident: Any, env: codec.Envelope, cls: type) -> None:
        what = f"mailbox of {env.target!r} for {cls.__name__} is full ({self.cfg.mailbox_size} queued)"
        if env.kind == codec.ASK:
            await self.router.send([ident, *codec.encode_error(env.msg_id, env.target, MailboxFull(what))])
            return
        self.refused += 1
        if self.refused <= 10 or self.refused % 1000 == 0:
            log.warning("tell_refused", actor=env.target, msg=cls.__name__, reason=what, count=self.refused)

    async def worker(self, name: str, box: Mailbox) -> None:
        """One of `box`'s workers (handler concurrency): runs its queued requests until cancelled."""
        while True:
            ident, env, deadline = await box.queue.get()
            box.busy += 1
            try:
                await self._run(name, box, ident, env, deadline)
            finally:
                box.busy -= 1

    async def _run(self, name: str, box: Mailbox, ident: Any, env: codec.Envelope,
                   deadline: float | None) -> None:
        try:
            if deadline is not None and time.monotonic() > deadline:
                raise PeerTimeout(f"request to {name!r} expired in its mailbox")
            result = box.method(env.body)
            if asyncio.iscoroutine(result):
                result = await result
            if env.kind == codec.ASK and (self.faults is None
                                          or await self.faults.admit(codec.REPLY, env.type_name)):
                await self.router.send([ident, *codec.encode(codec.REPLY, env.msg_id, "", result)])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every handler error goes back to the caller
            if env.kind == codec.ASK and (self.faults is None
                                          or await self.faults.admit(codec.ERROR, env.type_name)):
                await self.router.send([ident, *codec.encode_error(env.msg_id, name, exc)])
            else:
                log.error("tell_handler_failed", actor=name, msg=type(env.body).__name__,
                          error=f"{type(exc).__name__}: {exc}")
