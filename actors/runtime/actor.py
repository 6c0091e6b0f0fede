"""The `Actor` base class and the `@handler` decorator.

An actor declares one handler per message type. Each handler has a concurrency
limit (how many of its messages run at once), a queue bounded by the transport's
`mailbox_size`, and a policy for when that queue is full:

- `"block"` (default): the host stops reading its socket until there is room. The
  host reads ahead at most `mailbox_size` messages and ZeroMQ queues at most
  `mailbox_size` more per peer (its receive high-water mark); beyond that the
  senders' sends wait, and fail with `PeerTimeout` at their deadlines.
- `"refuse"`: the message is refused at once; an ask gets `MailboxFull`, a tell is
  counted in `Host.refused` and logged. The host keeps reading for other handlers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from miles.actors.runtime.host_view import ActorHost
from miles.actors.runtime.ref import ActorRef
from miles.transport.schema import spec_for_class

_ATTR = "__miles_handler__"
WhenFull = Literal["block", "refuse"]


@dataclass(frozen=True)
class HandlerSpec:
    msg_type: type
    concurrency: int
    when_full: WhenFull = "block"


def handler(msg_type: type, concurrency: int = 1,
            when_full: WhenFull = "block") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a method as the handler of `msg_type` (at most `concurrency` run at once).

    `when_full` says what a full mailbox does to a new message: "block" the sender
    (backpressure) or "refuse" it with `MailboxFull`.
    """
    if concurrency < 1:
        raise ValueError("handler concurrency must be >= 1")
    if when_full not in ("block", "refuse"):
        raise ValueError(f"handler when_full {when_full!r}: valid are 'block', 'refuse'")

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(fn, _ATTR, HandlerSpec(msg_type, concurrency, when_full))
        return fn

    return wrap


class Actor:
    """Base class: subclass, declare `@handler`s, optionally override `on_start` / `on_stop`."""

    name: str = ""
    host: ActorHost  # set by Host.add; typed by what an actor may use of it (host_view.py)

    async def on_start(self) -> None:
        """Called once after the actor is registered and before it receives messages."""

    def on_stopping(self) -> None:
        """Called once when the host begins to stop, before it drains: wake the handlers that wait
        for work that will not come now (the drain would otherwise wait out its grace for them)."""

    async def on_stop(self) -> None:
        """Called once while the host drains, after in-flight handlers finish."""

    def ref(self, name: str) -> ActorRef:
        return self.host.ref(name)

    @classmethod
    def handler_specs(cls) -> dict[str, tuple[str, HandlerSpec]]:
        """Map of message class name -> (method name, spec), gathered from the class tree."""
        out: dict[str, tuple[str, HandlerSpec]] = {}
        for klass in reversed(cls.__mro__):
            for attr, fn in vars(klass).items():
                spec = getattr(fn, _ATTR, None)
                if isinstance(spec, HandlerSpec):
                    mspec = spec_for_class(spec.msg_type)
                    if mspec is None:
                        raise TypeError(f"{cls.__name__}.{attr}: {spec.msg_type!r} is not a @message type")
                    out[mspec.name] = (attr, spec)
        return out


@dataclass
class Mailbox:
    """One handler's bounded queue and its worker tasks."""

    method: Callable[[Any], Awaitable[Any] | Any]
    queue: asyncio.Queue[Any]
    workers: list[asyncio.Task[None]]
    busy: int = 0
    sync: bool = False  # plain function (not a coroutine function): may run inline
    refuse: bool = False  # when_full == "refuse"
