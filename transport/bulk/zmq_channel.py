"""`zmq` channel: bucket tensors ride inside the `Stage` actor message as zero-copy frames.

The default and always available. Nothing moves outside the control message, so the
sender's transmit is empty and the engine's `Stage` handler is the receiver.
"""

from __future__ import annotations

from typing import Any

from miles.transport.bulk.base import BulkSender
from miles.transport.bulk.buckets import Bucket


class ZmqSender(BulkSender):
    tag = "zmq"
    inline = True
    flat = True  # a flat export's byte range rides as one frame (FlatRange.data)

    async def open(self, peers: list[str]) -> list[dict[str, Any]]:
        self.peers = list(peers)
        return [{} for _ in peers]

    def prepare(self, version: int, seq: int, bucket: Bucket) -> dict[str, Any]:
        return {}

    def prepare_flat(self, version: int, seq: int, lo: int, hi: int, weights: Any) -> dict[str, Any]:
        return {}

    async def transmit(self) -> None:
        """The bytes travel with the control message itself."""

    async def close(self) -> None:
        self.peers = []
