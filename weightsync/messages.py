"""Wire messages of the bulk weight channels (sync coordinator -> engine actors).

`Stage` carries zmq buckets inline; the others drive every other
channel: open a receiver with the sender's connect info, receive one bucket whose
bytes travel on the channel, close the receiver. A flat export (weightsync/flat.py)
sends its plan once and then byte ranges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from miles.transport.schema import message


@message("engine.Stage")
@dataclass
class Stage:
    """One weight bucket of `version`: HF names and the tensors (zero-copy frames)."""

    version: int
    names: list[str]
    tensors: list[torch.Tensor]


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


@message("engine.BulkPlan")
@dataclass
class BulkPlan:
    """The flat plan (weightsync/flat.py) of the byte ranges that follow; answered with
    whether this engine lands them (False: the coordinator sends tensors instead)."""

    plan: dict[str, Any]


@message("engine.FlatRange")
@dataclass
class FlatRange:
    """Bytes [lo, hi) of the flat plan `digest` for `version`: inline in `data` (zmq), else on the
    open channel, described by `header`."""

    version: int
    digest: str
    lo: int
    hi: int
    header: dict[str, Any] = field(default_factory=dict)
    data: torch.Tensor | None = None
