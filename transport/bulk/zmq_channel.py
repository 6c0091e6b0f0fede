"""`zmq` channel: the bytes ride inside the control message as zero-copy frames.

The default and always available. Nothing moves outside the control message, so the sender's
transmit and send are empty and the engine's handler is the receiver: a gathered bucket's
tensors travel in the `Stage` message, a flat range in `FlatRange.data`, a sharded bucket (a
gathered flat export's too, as one rank) in its `FlatRange` header (`data`).
"""

from __future__ import annotations

from typing import Any

import torch

from miles.transport.bulk.base import BulkSender
from miles.transport.bulk.buckets import Bucket


class ZmqSender(BulkSender):
    tag = "zmq"
    inline = True
    flat = True  # a flat export's byte range rides as one frame (FlatRange.data)
    sharded = True  # a sharded bucket rides in its header

    async def open(self, peers: list[str], shared: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.peers = list(peers)
        return [{} for _ in peers]

    def prepare(self, version: int, seq: int, bucket: Bucket) -> dict[str, Any]:
        return {}

    def prepare_flat(self, version: int, seq: int, lo: int, hi: int, weights: Any) -> dict[str, Any]:
        return {}

    async def transmit(self) -> None:
        """The bytes travel with the control message itself."""

    def header(self, seq: int, data: torch.Tensor) -> dict[str, Any]:
        return {**super().header(seq, data), "data": data if data.device.type == "cpu" else data.to("cpu")}

    async def send(self, peer: int, seq: int, data: torch.Tensor) -> None:
        """The bytes travel with the header."""

    async def close(self) -> None:
        self.peers = []
