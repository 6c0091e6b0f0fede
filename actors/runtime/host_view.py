"""`ActorHost`: the host as an actor sees it (`Actor.host`).

Actors call their host (refs, death callbacks, lookups, broadcasts), and the host holds its
actors, so typing `Actor.host` as the concrete `Host` made actor.py and host.py import each
other. This Protocol names only what actors use; `Host` satisfies it structurally, and the
runtime's modules then depend downward only: host -> actor -> host_view -> ref, messages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from miles.actors.runtime.messages import DeathNotice, Location
from miles.actors.runtime.ref import ActorRef, Messenger


class ActorHost(Messenger, Protocol):
    """The surface of `Host` that actors (the role actors and the directory) use."""

    host_id: str  # changes when the host rejoins under a new incarnation
    address: str  # the ROUTER address peers send to
    pub_address: str  # the PUB address subscribers connect to

    def ref(self, name: str) -> ActorRef:
        """A handle on the actor named `name`, resolved through the directory on first use."""
        ...

    def on_death(self, callback: Callable[[DeathNotice], Any]) -> None:
        """Call `callback(notice)` whenever the directory declares actors dead."""
        ...

    async def lookup(self, name: str, timeout: float) -> Location:
        """Wait (up to `timeout`) until `name` is registered and return where it lives."""
        ...

    async def publish(self, topic: str, msg: Any) -> None:
        """Broadcast `msg` to every subscriber of `topic`."""
        ...

    async def subscribe(self, publisher: str, topic: str, callback: Callable[[Any], Any],
                        timeout: float = 30.0) -> None:
        """Receive `topic` broadcasts from the host that runs actor `publisher`."""
        ...

    def hear_death(self, notice: DeathNotice) -> None:
        """Act on a death notice (the directory hands its own to the host it runs on)."""
        ...
