"""`ActorRef`: how one actor talks to another, by name, through its host.

A ref needs only the host's three sends by name, so it holds a `Messenger` (declared here,
where it is used) rather than the `Host`: this module imports nothing of the runtime, and
host.py, which builds refs, depends on it and not the other way round.
"""

from __future__ import annotations

from typing import Any, Protocol


class Messenger(Protocol):
    """What a ref sends through: the host's ask / tell / tell_many by actor name."""

    async def ask(self, name: str, msg: Any, timeout: float) -> Any: ...

    async def tell(self, name: str, msg: Any, timeout: float | None = None) -> None: ...

    async def tell_many(self, name: str, msgs: list[Any], timeout: float | None = None) -> None: ...


class ActorRef:
    """A handle on a named actor; resolves its address through the directory on first use."""

    __slots__ = ("host", "name")

    def __init__(self, host: Messenger, name: str) -> None:
        self.host = host
        self.name = name

    async def ask(self, msg: Any, *, timeout: float) -> Any:
        """Send `msg` and await the reply; raises PeerTimeout, ActorDeadError or the remote error.

        A deadline is required: no wait in miles is unbounded.
        """
        return await self.host.ask(self.name, msg, timeout)

    async def tell(self, msg: Any, *, timeout: float | None = None) -> None:
        """Send `msg` without waiting for a reply.

        Waits out backpressure up to `timeout` (the transport's default deadline when
        None), then raises PeerTimeout: the message was not sent.
        """
        await self.host.tell(self.name, msg, timeout)

    async def tell_many(self, msgs: list[Any], *, timeout: float | None = None) -> None:
        """Send many records in one wire message (batched; far cheaper per message)."""
        await self.host.tell_many(self.name, msgs, timeout)

    def __repr__(self) -> str:
        return f"ActorRef({self.name!r})"
