"""The directory actor: name -> address registry, wait-for-name, heartbeats and death notices.

It runs in the head process. A host that misses heartbeats for
`heartbeat_timeout_s` is declared dead: its names are removed and a
`DeathNotice` is published so waiting asks fail with `ActorDeadError`.

A host declared dead that is in fact alive (its loop stalled) hears the notice
and registers its actors again under a new incarnation (`Host._rejoin`). Until
it does, its heartbeats under the dead id repeat the notice, in case the
broadcast was lost. A stall of the directory's own loop is not blamed on the
hosts: the silence it measures excludes its own lateness.
"""

from __future__ import annotations

import asyncio
import time

from miles.actors.runtime.actor import Actor, handler
from miles.actors.runtime.messages import (
    DEATH_TOPIC,
    ActorList,
    DeathNotice,
    Heartbeat,
    ListActors,
    Location,
    Lookup,
    Register,
    Unregister,
)
from miles.core.errors import MilesError, PeerTimeout
from miles.core.logging import get_logger

log = get_logger("miles.directory")


class Directory(Actor):
    def __init__(self, heartbeat_timeout_s: float = 3.0, heartbeat_interval_s: float = 0.5) -> None:
        self.timeout = heartbeat_timeout_s
        self.interval = heartbeat_interval_s
        self.entries: dict[str, Location] = {}
        self.last_seen: dict[str, float] = {}
        self.dead: dict[str, DeathNotice] = {}  # host id -> the notice that declared it dead
        self._changed = asyncio.Event()
        self._monitor: asyncio.Task[None] | None = None

    async def on_start(self) -> None:
        self._monitor = asyncio.create_task(self._watch(), name="directory-watch")

    async def on_stop(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()

    @handler(Register, concurrency=4)
    async def register(self, msg: Register) -> Location:
        if msg.host_id in self.dead:
            raise MilesError(f"host {msg.host_id} was declared dead; it must rejoin under a new incarnation")
        old = self.entries.get(msg.name)
        if old is not None and old.host_id != msg.host_id and old.host_id in self.last_seen:
            silent = time.monotonic() - self.last_seen[old.host_id]
            if silent < 2 * self.interval:
                raise MilesError(f"actor name {msg.name!r} is already taken by live host {old.host_id}")
            # The old holder went quiet (a crashed process being replaced): the new one takes over,
            # and everyone is told the old host is dead so no one keeps its stale address.
            log.warning("actor_taken_over", actor=msg.name, old_host=old.host_id, silent_s=round(silent, 2))
            await self._declare_dead(old.host_id, f"replaced by {msg.host_id} after {silent:.1f}s of silence")
        loc = Location(msg.name, msg.address, msg.pub_address, msg.host_id)
        self.entries[msg.name] = loc
        self.last_seen[msg.host_id] = time.monotonic()
        self._changed.set()
        log.info("actor_registered", actor=msg.name, address=msg.address)
        return loc

    @handler(Unregister, concurrency=4)
    def unregister(self, msg: Unregister) -> bool:
        loc = self.entries.get(msg.name)
        if loc is not None and loc.host_id == msg.host_id:
            del self.entries[msg.name]
            if not any(e.host_id == msg.host_id for e in self.entries.values()):
                # A host with no names left sends no heartbeats: stop watching it, or its
                # silence would be reported as a (nameless) death.
                self.last_seen.pop(msg.host_id, None)
            return True
        return False

    @handler(Lookup, concurrency=256)
    async def lookup(self, msg: Lookup) -> Location:
        if msg.name == "directory":
            return Location("directory", self.host.address, self.host.pub_address, self.host.host_id)
        deadline = time.monotonic() + msg.wait_s
        while msg.name not in self.entries:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if msg.wait_s > 0:
                    raise PeerTimeout(f"no actor named {msg.name!r} registered within {msg.wait_s:.3g}s")
                raise MilesError(f"no actor named {msg.name!r} is registered")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                continue
        return self.entries[msg.name]

    @handler(ListActors)
    def list_actors(self, msg: ListActors) -> ActorList:
        return ActorList(sorted(n for n in self.entries if n.startswith(msg.prefix)))

    @handler(Heartbeat, concurrency=4)
    def heartbeat(self, msg: Heartbeat) -> None:
        self.beat(msg)

    def beat(self, msg: Heartbeat) -> None:
        notice = self.dead.get(msg.host_id)
        if notice is not None:
            # A host declared dead is beating: tell it again so it rejoins (the PUB may have dropped it).
            asyncio.get_running_loop().create_task(self.host.publish(DEATH_TOPIC, notice))
            return
        self.last_seen[msg.host_id] = time.monotonic()

    async def _watch(self) -> None:
        period = self.timeout / 4
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(period)
            now = time.monotonic()
            late = now - t0 - period
            if late > period:
                # This loop stalled: heartbeats may sit unread in our own socket. Credit every
                # host with the stall instead of declaring them dead for our lateness.
                for host_id in self.last_seen:
                    self.last_seen[host_id] += late
                log.warning("directory_loop_stalled", late_s=round(late, 2))
                continue
            for host_id, seen in list(self.last_seen.items()):
                if now - seen <= self.timeout:
                    continue
                await self._declare_dead(host_id, f"host {host_id} missed heartbeats for {now - seen:.1f}s")

    async def _declare_dead(self, host_id: str, reason: str) -> None:
        """Forget a host's names and tell every host (this one included) that they died."""
        self.last_seen.pop(host_id, None)
        names = [n for n, loc in self.entries.items() if loc.host_id == host_id]
        for n in names:
            del self.entries[n]
        log.warning("actors_dead", host=host_id, actors=names, reason=reason)
        notice = DeathNotice(host_id, names, reason)
        if names:
            self.dead[host_id] = notice
        self.host.hear_death(notice)  # actors co-hosted with the directory learn it too
        await self.host.publish(DEATH_TOPIC, notice)
