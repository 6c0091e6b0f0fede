"""`cuda_ipc` channel: trainer and engine share one GPU; the engine reads the trainer's buffer.

The trainer packs each bucket into one pre-allocated device buffer whose CUDA IPC
handle is exported once per run (mapping is expensive; per-update it would dominate).
The handle's fields (ints and bytes) travel in the msgpack open message, never
pickled; the engine maps the buffer once and copies each bucket out of it.
"""

from __future__ import annotations

from typing import Any

import torch

from miles.core.errors import SyncError
from miles.core.schema.sync import SyncConfig
from miles.transport.bulk.base import (
    BulkReceiver,
    BulkSender,
    Layout,
    LocalWeights,
    pack_into,
    unpack,
)
from miles.transport.bulk.buckets import Bucket

_HANDLE_KEYS = ("device", "handle", "size", "offset", "ref_handle", "ref_offset", "event", "event_sync")


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        raise SyncError("sync.transport='cuda_ipc' needs CUDA (trainer and engine on one GPU); "
                        "none is available in this process")


class CudaIpcSender(BulkSender):
    tag = "cuda_ipc"

    def __init__(self, cfg: SyncConfig) -> None:
        _need_cuda()
        super().__init__(cfg)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._buf = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device)
        self._info: dict[str, Any] | None = None

    async def open(self, peers: list[str]) -> list[dict[str, Any]]:
        if self._info is None:
            fields = self._buf.untyped_storage()._share_cuda_()
            self._info = dict(zip(_HANDLE_KEYS, fields, strict=True))
        self.peers = list(peers)
        return [dict(self._info, bucket_bytes=self.bucket_bytes) for _ in peers]

    def prepare(self, version: int, seq: int, bucket: Bucket) -> dict[str, Any]:
        lay = pack_into(bucket, self._buf)
        torch.cuda.current_stream(self.device).synchronize()  # bytes are in place before the header leaves
        return {"layout": lay.to_wire()}

    async def transmit(self) -> None:
        """Nothing moves: the engine reads the shared buffer once it has the header."""

    async def close(self) -> None:
        self.peers = []


class CudaIpcReceiver(BulkReceiver):
    tag = "cuda_ipc"

    def __init__(self, info: dict[str, Any], bucket_bytes: int) -> None:
        _need_cuda()
        super().__init__(info, bucket_bytes)
        self._shared: torch.Tensor | None = None

    async def open(self) -> None:
        try:
            fields = tuple(self.info[k] for k in _HANDLE_KEYS)
        except KeyError as exc:
            raise SyncError(f"cuda_ipc open info lacks {exc}") from exc
        storage = torch.UntypedStorage._new_shared_cuda(*fields)
        self._shared = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

    async def recv(self, header: dict[str, Any], local: LocalWeights) -> list[tuple[str, torch.Tensor]]:
        if self._shared is None:
            raise SyncError("cuda_ipc: recv before open")
        # Views of the trainer's buffer: the engine's stage copies them before the next bucket.
        return unpack(Layout.from_wire(header["layout"]), self._shared)

    async def close(self) -> None:
        self._shared = None
