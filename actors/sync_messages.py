"""Wire messages of the bulk weight channels (sync coordinator -> engine actors).

`Stage` (actors/messages.py) carries zmq buckets inline; these drive every other
channel: open a receiver with the sender's connect info, receive one bucket whose
bytes travel on the channel, close the receiver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles.transport.schema import message


@message("engine.BulkOpen")
@dataclass
class BulkOpen:
    """Connect a receiver of channel `transport` using the sender's `info` (replaces any open one)."""

    transport: str
    info: dict[str, Any]
    bucket_bytes: int


@message("engine.BulkRecv")
@dataclass
class BulkRecv:
    """Receive bucket `header` of `version` on the open channel and stage it."""

    version: int
    header: dict[str, Any] = field(default_factory=dict)


@message("engine.BulkClose")
@dataclass
class BulkClose:
    pass
