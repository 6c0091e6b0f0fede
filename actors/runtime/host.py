"""The process host: one ROUTER socket in, DEALER sockets out, actors dispatched by name.

A host runs any number of actors in one asyncio loop. It registers them with the
directory, sends heartbeats, fails asks to peers the directory declares dead,
and drains on stop. Its inbound half (mailboxes, dispatch, handler runs, `ProtocolError`
replies to malformed input) is `inbox.py`'s `Inbox`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from miles.actors.runtime.actor import Actor, Mailbox
from miles.actors.runtime.inbox import Inbox
from miles.actors.runtime.liveness import directory_heartbeats, heartbeat_thread, lag_monitor
from miles.actors.runtime.messages import (
    DEATH_TOPIC,
    DIRECTORY_NAME,
    DeathNotice,
    Location,
    Lookup,
    Register,
    Unregister,
)
from miles.actors.runtime.pubsub import Subscriber, publish_frames
from miles.actors.runtime.ref import ActorRef
from miles.core.errors import (
    ActorDeadError,
    MilesError,
    PeerTimeout,
    ProtocolError,
    remote_exception,
)
from miles.core.logging import get_logger
from miles.core.schema.transport import TransportConfig
from miles.transport import codec
from miles.transport.curve import make_curve_client, make_curve_server
from miles.transport.faults import FaultHook
from miles.transport.schema import spec_for_class
from miles.transport.sockets import (
    LoopSocket,
    QueuedLoopSocket,
    apply_options,
    bind,
    socket,
)

log = get_logger("miles.host")


class Host:
    """Runs actors in this process and routes their messages."""

    def __init__(self, cfg: TransportConfig | None = None, directory: str | None = None,
                 host_id: str = "") -> None:
        self.cfg = cfg or TransportConfig()
        self.directory_addr = directory
        self.host_id = host_id or f"{os.uname().nodename}:{os.getpid()}:{os.urandom(3).hex()}"
        self._base_id = self.host_id
        self.incarnation = 1  # bumped when the directory wrongly declared this host dead and it rejoined
        self._rejoining: asyncio.Task[None] | None = None
        self._old_ids: set[str] = set()
        self.address = ""
        self.pub_address = ""
        self.actors: dict[str, Actor] = {}
        # msg id -> (future, target name, target host id or "" when not known)
        self._pending: dict[int, tuple[asyncio.Future[Any], str, str]] = {}
        self._ids = itertools.count(1)
        self._dealers: dict[str, Any] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._locations: dict[str, Location] = {}
        self._dead: set[str] = set()
        self._dead_hosts: set[str] = set()
        self._death_callbacks: list[Callable[[DeathNotice], Any]] = []
        self._subscriber: Subscriber | None = None
        self.stale_replies = 0  # replies to asks already failed (deadline, death): refused
        self.loop_lag_ms = 0.0
        self.max_loop_lag_ms = 0.0
        # True while the process sets up its actors (serve(): imports, model loads and compiles
        # run on the loop), and when that ended: a stall that began before then is expected and
        # logged at debug, not warned about (it is measured only when the loop gets back)
        self.starting = False
        self.serving_since = 0.0
        self._stopping = False
        # Read by the heartbeat thread (liveness.HostPulse): the loop's last sign of life (set by
        # the lag monitor), and the event that stops the beats.
        self.last_tick = time.monotonic()
        self.beat_stop = threading.Event()
        self._beat_thread: threading.Thread | None = None
        # Fault injection for soak tests (transport.faults): None unless configured, and then
        # each send below is one `is None` test away from what it is without it.
        self.faults = FaultHook.from_config(self.cfg.faults)
        self._inbox = Inbox(self.cfg, self.faults, lambda: self.host_id)

    @property
    def protocol_errors(self) -> int:
        """Malformed requests and replies, unknown actors and unhandled types (inbox.py)."""
        return self._inbox.protocol_errors

    @property
    def refused(self) -> int:
        """Tells refused by a full "refuse" mailbox (inbox.py)."""
        return self._inbox.refused

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        # The receive side is bounded by the mailbox size: ZeroMQ queues at most that many
        # messages per peer, and the host reads ahead at most that many (see actor.py).
        apply_options(self._router, self.cfg.hwm, self.cfg.linger_ms, self.cfg.max_frame_bytes,
                      rcvhwm=self.cfg.mailbox_size)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if self.cfg.curve_server_key:
            make_curve_server(self._router, self.cfg.curve_server_key, self.cfg.curve_allow_dir)
        self.address = bind(self._router, self.cfg.scheme, self.cfg.interface, "router", self.cfg.ipc_dir)
        self._rfast = QueuedLoopSocket(self._router, self.cfg.mailbox_size)
        self._rfast.start(asyncio.get_running_loop())
        self._pub = socket(zmq.PUB, hwm=self.cfg.hwm, linger_ms=self.cfg.linger_ms)
        if self.cfg.curve_server_key:
            make_curve_server(self._pub, self.cfg.curve_server_key, self.cfg.curve_allow_dir)
        self.pub_address = bind(self._pub, self.cfg.scheme, self.cfg.interface, "pub", self.cfg.ipc_dir)
        self._subscriber = Subscriber(self.cfg)
        self._tasks.append(asyncio.create_task(self._inbox.serve(self._rfast), name="host-recv"))
        self._tasks.append(asyncio.create_task(lag_monitor(self), name="host-lag"))
        if self.directory_addr is None:
            # This host will run the directory itself.
            self.directory_addr = self.address
        else:
            await self._watch_deaths()
        if self.directory_addr == self.address:
            self._tasks.append(asyncio.create_task(directory_heartbeats(self), name="host-heartbeat"))
        else:
            # Heartbeats from a thread: a loop busy for a few seconds (imports, a long GC, a
            # blocking call) is not a dead process. A loop stuck past loop_stall_timeout_s is.
            self._beat_thread = threading.Thread(target=heartbeat_thread, args=(self, self.directory_addr),
                                                 name="miles-heartbeat", daemon=True)
            self._beat_thread.start()

    async def _watch_deaths(self) -> None:
        assert self._subscriber is not None
        loc = await self._lookup(DIRECTORY_NAME, wait_s=0.0, timeout=self.cfg.default_deadline_s)
        await self._subscriber.subscribe(loc.pub_address, DEATH_TOPIC, self.hear_death)

    async def add(self, actor: Actor, name: str) -> ActorRef:
        """Start serving `actor` under `name` and register it with the directory."""
        if name in self.actors:
            raise MilesError(f"actor {name!r} already runs on this host")
        actor.name = name
        actor.host = self
        boxes: dict[str, Mailbox] = {}
        for type_name, (method, spec) in actor.handler_specs().items():
            q: asyncio.Queue[Any] = asyncio.Queue(maxsize=self.cfg.mailbox_size)
            fn = getattr(actor, method)
            box = Mailbox(fn, q, [], sync=not asyncio.iscoroutinefunction(fn),
                          refuse=spec.when_full == "refuse")
            box.workers = [
                asyncio.create_task(self._inbox.worker(name, box), name=f"{name}.{method}")
                for _ in range(spec.concurrency)
            ]
            boxes[type_name] = box
        self.actors[name] = actor
        self._inbox.mailboxes[name] = boxes
        await actor.on_start()
        if name != DIRECTORY_NAME or self.directory_addr != self.address:
            await self._directory_ask(Register(name, self.address, self.pub_address, self.host_id))
        self._locations[name] = Location(name, self.address, self.pub_address, self.host_id)
        return self.ref(name)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Drain: stop heartbeats, unregister, finish queued work (bounded), on_stop, close."""
        if self._stopping:
            return
        self._stopping = True
        self.beat_stop.set()
        for name, actor in self.actors.items():
            try:
                actor.on_stopping()
            except Exception as exc:  # noqa: BLE001  # a hook's bug must not keep the host from stopping
                log.warning("on_stopping_failed", actor=name, error=f"{type(exc).__name__}: {exc}")
        for name in list(self.actors):
            if name != DIRECTORY_NAME and self.directory_addr != self.address:
                try:
                    await self._directory_ask(Unregister(name, self.host_id), timeout=1.0)
                except MilesError as exc:
                    log.warning("unregister_failed", actor=name, error=str(exc))
        deadline = time.monotonic() + grace_s
        for boxes in self._inbox.mailboxes.values():
            for box in boxes.values():
                while (box.queue.qsize() or box.busy) and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
        for name, actor in self.actors.items():
            bound = max(0.1, deadline - time.monotonic())
            try:
                await asyncio.wait_for(actor.on_stop(), bound)
            except TimeoutError:
                # str() of a TimeoutError is empty: the line says what ran out (an SGLang engine's server
                # can take longer than this to exit; it still gets SIGTERM when this process ends)
                log.warning("on_stop_failed", actor=name, error=f"on_stop did not finish within {bound:.1f} s "
                            f"of the host's {grace_s:g} s stop grace; the process exits without it")
            except (MilesError, OSError) as exc:
                log.warning("on_stop_failed", actor=name, error=f"{type(exc).__name__}: {exc}")
        tasks = list(self._tasks)
        for boxes in self._inbox.mailboxes.values():
            for box in boxes.values():
                tasks += box.workers
        if self._subscriber is not None:
            tasks += self._subscriber.tasks
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for fut, _, _ in self._pending.values():
            if not fut.done():
                fut.set_exception(ActorDeadError("host is stopping"))
        for d in self._dealers.values():
            d.close()
        if self._subscriber is not None:
            self._subscriber.close()
        self._rfast.close()
        self._pub.close(0)

    # ---------------------------------------------------------------- outgoing
    def ref(self, name: str) -> ActorRef:
        return ActorRef(self, name)

    def on_death(self, callback: Callable[[DeathNotice], Any]) -> None:
        """Call `callback(notice)` whenever the directory declares actors dead."""
        self._death_callbacks.append(callback)

    async def lookup(self, name: str, timeout: float) -> Location:
        """Wait (up to `timeout`) until `name` is registered and return where it lives."""
        return await self._lookup(name, wait_s=timeout, timeout=timeout + 1.0)

    async def _lookup(self, name: str, wait_s: float, timeout: float) -> Location:
        if name == DIRECTORY_NAME:
            return Location(name, self.directory_addr or "", await self._directory_pub(), "")
        loc = self._locations.get(name)
        if loc is None:
            loc = await self._directory_ask(Lookup(name, wait_s), timeout=timeout)
            if loc.host_id in self._dead_hosts:
                # A lookup answered just before the death notice arrived: the address is stale.
                raise ActorDeadError(f"actor {name!r} is dead (its host {loc.host_id} missed heartbeats)")
            self._locations[name] = loc
            self._dead.discard(name)
        return loc

    async def _directory_pub(self) -> str:
        if self.directory_addr == self.address:
            return self.pub_address
        loc = self._locations.get("__directory_pub__")
        if loc is None:
            reply = await self._send_ask(self.directory_addr or "", DIRECTORY_NAME,
                                         Lookup(DIRECTORY_NAME), self.cfg.default_deadline_s)
            loc = reply
            self._locations["__directory_pub__"] = loc
        return loc.pub_address

    async def _directory_ask(self, msg: Any, timeout: float | None = None) -> Any:
        return await self._send_ask(self.directory_addr or "", DIRECTORY_NAME, msg,
                                    timeout or self.cfg.default_deadline_s)

    async def _check_alive(self, name: str) -> None:
        """A name the directory declared dead fails fast, unless it has registered again."""
        if name not in self._dead:
            return
        try:
            await self._lookup(name, wait_s=0.0, timeout=self.cfg.default_deadline_s)
        except MilesError as exc:
            raise ActorDeadError(f"actor {name!r} is dead (missed heartbeats)") from exc

    async def ask(self, name: str, msg: Any, timeout: float) -> Any:
        await self._check_alive(name)
        t0 = time.monotonic()
        loc = await self._lookup(name, wait_s=0.0, timeout=timeout)
        try:
            return await self._send_ask(loc.address, name, msg, max(0.0, timeout - (time.monotonic() - t0)),
                                        loc.host_id)
        except PeerTimeout:
            # The peer may have been replaced at another address: resolve afresh next time.
            if self._locations.get(name) is loc:
                self._locations.pop(name, None)
            raise

    async def _send_ask(self, address: str, name: str, msg: Any, timeout: float, target_host: str = "") -> Any:
        msg_id = next(self._ids)
        frames = codec.encode(codec.ASK, msg_id, name, msg, timeout, self.host_id)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending[msg_id] = (fut, name, target_host)
        # A timer handle instead of asyncio.wait_for: no extra task per request.
        timer = loop.call_later(timeout, _expire, fut, name, address, timeout, type(msg).__name__)
        try:
            # The deadline covers the send: a peer whose queue stays full fails the ask in time.
            if self.faults is None or await self.faults.admit(codec.ASK, _wire_name(msg)):
                await self._dealer(address).send(frames, time.monotonic() + timeout,
                                                 f"{type(msg).__name__} to {name!r} at {address}")
            return await fut
        except PeerTimeout:
            if fut.done() and not fut.cancelled():
                fut.exception()  # the timer fired too: mark its exception as seen
            raise
        finally:
            timer.cancel()
            self._pending.pop(msg_id, None)

    async def tell(self, name: str, msg: Any, timeout: float | None = None) -> None:
        """Send without a reply; waits out backpressure up to `timeout` (default_deadline_s)."""
        t = timeout if timeout is not None else self.cfg.default_deadline_s
        deadline = time.monotonic() + t
        await self._check_alive(name)
        loc = await self._lookup(name, 0.0, t)
        frames = codec.encode(codec.TELL, None, name, msg, None, self.host_id)
        if self.faults is None or await self.faults.admit(codec.TELL, _wire_name(msg)):
            await self._dealer(loc.address).send(frames, deadline, f"{type(msg).__name__} to {name!r}")

    async def tell_many(self, name: str, msgs: list[Any], timeout: float | None = None) -> None:
        t = timeout if timeout is not None else self.cfg.default_deadline_s
        deadline = time.monotonic() + t
        await self._check_alive(name)
        loc = await self._lookup(name, 0.0, t)
        frames = codec.encode_batch(name, msgs, self.host_id)
        if self.faults is None or await self.faults.admit(codec.BATCH, _wire_name(msgs[0]) if msgs else ""):
            await self._dealer(loc.address).send(frames, deadline, f"{len(msgs)} records to {name!r}")

    async def publish(self, topic: str, msg: Any) -> None:
        """Broadcast `msg` to every subscriber of `topic` on this host's PUB socket."""
        await publish_frames(self._pub, topic, codec.encode(codec.TELL, None, topic, msg))

    async def subscribe(self, publisher: str, topic: str, callback: Callable[[Any], Any],
                        timeout: float = 30.0) -> None:
        """Receive `topic` broadcasts from the host that runs actor `publisher`."""
        assert self._subscriber is not None
        loc = await self.lookup(publisher, timeout)
        await self._subscriber.subscribe(loc.pub_address, topic, callback)

    def _dealer(self, address: str) -> LoopSocket:
        d = self._dealers.get(address)
        if d is None:
            sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
            apply_options(sock, self.cfg.hwm, self.cfg.linger_ms, self.cfg.max_frame_bytes)
            if self.cfg.curve_client_key:
                make_curve_client(sock, self.cfg.curve_client_key, self.cfg.curve_public_key)
            sock.connect(address)
            d = LoopSocket(sock, self._on_reply)
            d.start(asyncio.get_running_loop())
            self._dealers[address] = d
        return d

    def _on_reply(self, frames: list[Any]) -> None:
        try:
            env = codec.decode(frames, self.cfg.max_frame_bytes)
        except ProtocolError as exc:
            self._inbox.count_protocol_error("reply", exc)
            return
        entry = self._pending.get(env.msg_id) if env.msg_id is not None else None
        if entry is None or entry[0].done():
            # A reply to an ask that already failed (deadline, or its target declared dead):
            # refused, so a stale answer never resolves anything.
            self.stale_replies += 1
            return
        fut = entry[0]
        if env.kind == codec.ERROR:
            fut.set_exception(remote_exception(*env.body))
        else:
            fut.set_result(env.body)

    # ---------------------------------------------------------------- liveness
    def hear_death(self, notice: DeathNotice) -> None:
        """Act on a death notice: fail asks to the dead, forget their addresses, or rejoin."""
        if notice.host_id == self.host_id and notice.names:
            # This host is alive: the directory missed its heartbeats (a stalled loop, a long GC).
            if not self._stopping and (self._rejoining is None or self._rejoining.done()):
                self._rejoining = asyncio.create_task(self._rejoin(notice), name="host-rejoin")
            return
        if notice.host_id in self._old_ids:
            return  # a repeat of the notice that made this host rejoin
        self._dead_hosts.add(notice.host_id)
        for name in notice.names:
            known = self._locations.get(name)
            # A name already known at a newer incarnation (a rejoin) is not dead again.
            if known is None or known.host_id == notice.host_id:
                self._dead.add(name)
                self._locations.pop(name, None)
        for name, loc in list(self._locations.items()):
            if loc.host_id == notice.host_id:
                self._locations.pop(name, None)
        dead = set(notice.names)
        for fut, target, target_host in list(self._pending.values()):
            if target in dead and target_host in ("", notice.host_id) and not fut.done():
                fut.set_exception(ActorDeadError(f"actor {target!r} died: {notice.reason}"))
        for cb in self._death_callbacks:
            cb(notice)

    async def _rejoin(self, notice: DeathNotice) -> None:
        """Register every actor again under a new incarnation: same names, same address.

        Peers failed their asks to the old incarnation when they heard of its death; its
        late replies find no pending request and are refused (`stale_replies`). This rewrites
        the host's identity and address book, so it is a method here, not a liveness helper.
        """
        old = self.host_id
        self._old_ids.add(old)
        self.incarnation += 1
        self.host_id = f"{self._base_id}#{self.incarnation}"
        log.warning("host_rejoining", old_host=old, host=self.host_id, reason=notice.reason)
        for name in list(self.actors):
            if name == DIRECTORY_NAME:
                continue
            self._locations[name] = Location(name, self.address, self.pub_address, self.host_id)
            try:
                await self._directory_ask(Register(name, self.address, self.pub_address, self.host_id))
            except MilesError as exc:
                log.error("rejoin_failed", actor=name, error=str(exc))
                return
        self._dead_hosts.add(old)
        log.warning("host_rejoined", host=self.host_id, actors=[n for n in self.actors if n != DIRECTORY_NAME])


def _wire_name(msg: Any) -> str:
    """A message's registered wire name (e.g. engine.Generate): what transport.faults.drop_types names."""
    spec = spec_for_class(type(msg))
    return spec.name if spec is not None else type(msg).__name__


def _expire(fut: asyncio.Future[Any], name: str, address: str, timeout: float, what: str) -> None:
    if not fut.done():
        fut.set_exception(PeerTimeout(
            f"no reply from {name!r} at {address} within {timeout:.3g}s (request {what})"))
