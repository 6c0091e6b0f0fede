"""`ucx` channel: UCXX endpoints from trainer rank 0 to each engine (the `ucx` extra).

Rank 0 listens; each engine connects once per run and announces its index, so
endpoints and the staging buffers (registered once, not per update) are reused for
every bucket. Receivers write straight into their pre-allocated staging buffer.
UCXX is imported lazily: without it this channel raises a clear error.
"""

from __future__ import annotations

import asyncio
import time
from types import ModuleType
from typing import Any

import numpy as np
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


def import_ucxx() -> ModuleType:
    try:
        import ucxx
    except ImportError as exc:
        raise SyncError("sync.transport='ucx' needs UCXX: pip install 'miles[ucx]' (ucxx-cu12, which "
                        f"pulls CUDA libraries: rmm, cuda-core); import failed: {exc}") from exc
    return ucxx  # type: ignore[no-any-return]


def _np(t: torch.Tensor) -> Any:
    return t.numpy() if t.device.type == "cpu" else t  # CUDA tensors expose __cuda_array_interface__


class UcxSender(BulkSender):
    tag = "ucx"

    def __init__(self, cfg: SyncConfig) -> None:
        super().__init__(cfg)
        self.ucxx = import_ucxx()
        self.advertise = "127.0.0.1"
        self._listener: Any = None
        self._eps: dict[int, Any] = {}
        self._buf = torch.empty(self.bucket_bytes, dtype=torch.uint8)
        self._lay: Layout | None = None

    async def _accept(self, ep: Any) -> None:
        who = np.empty(1, dtype=np.int64)
        await ep.recv(who)
        self._eps[int(who[0])] = ep

    async def open(self, peers: list[str]) -> list[dict[str, Any]]:
        await self.close()
        self._listener = self.ucxx.create_listener(self._accept)
        self.peers = list(peers)
        return [{"addr": self.advertise, "port": self._listener.port, "index": i} for i in range(len(peers))]

    async def _connected(self) -> None:
        deadline = time.monotonic() + self.cfg.step_timeout_s
        while len(self._eps) < len(self.peers):
            if time.monotonic() > deadline:
                raise SyncError(f"ucx: {len(self._eps)}/{len(self.peers)} engines connected "
                                f"within {self.cfg.step_timeout_s}s")
            await asyncio.sleep(0.005)

    def prepare(self, version: int, seq: int, bucket: Bucket) -> dict[str, Any]:
        if bucket.nbytes > self._buf.numel():
            self._buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
        self._lay = pack_into(bucket, self._buf)
        return {"layout": self._lay.to_wire()}

    async def transmit(self) -> None:
        await self._connected()
        if self._lay is None:
            raise SyncError("ucx: transmit before prepare")
        view = _np(self._buf[: self._lay.nbytes])
        await asyncio.gather(*(ep.send(view) for ep in self._eps.values()))

    async def close(self) -> None:
        for ep in self._eps.values():
            await ep.close()
        self._eps = {}
        if self._listener is not None:
            self._listener.close()
            self._listener = None


class UcxReceiver(BulkReceiver):
    tag = "ucx"

    def __init__(self, info: dict[str, Any], bucket_bytes: int) -> None:
        super().__init__(info, bucket_bytes)
        self.ucxx = import_ucxx()
        self._buf = torch.empty(bucket_bytes, dtype=torch.uint8)
        self._ep: Any = None

    async def open(self) -> None:
        try:
            addr, port, index = str(self.info["addr"]), int(self.info["port"]), int(self.info["index"])
        except (KeyError, ValueError) as exc:
            raise SyncError(f"ucx open info is malformed: {exc}") from exc
        self._ep = await self.ucxx.create_endpoint(addr, port)
        await self._ep.send(np.array([index], dtype=np.int64))

    async def recv(self, header: dict[str, Any], local: LocalWeights) -> list[tuple[str, torch.Tensor]]:
        if self._ep is None:
            raise SyncError("ucx: recv before open")
        lay = Layout.from_wire(header["layout"])
        if lay.nbytes > self._buf.numel():
            self._buf = torch.empty(lay.nbytes, dtype=torch.uint8)
        await self._ep.recv(_np(self._buf[: lay.nbytes]))
        return unpack(lay, self._buf)

    async def close(self) -> None:
        if self._ep is not None:
            await self._ep.close()
            self._ep = None
