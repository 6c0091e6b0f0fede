"""`cuda_ipc` channel: trainer and engine share one GPU; the engine copies from the trainer's memory.

Single copy: the header of a bucket carries the CUDA IPC handle of each trainer storage
its tensors live in (ints and bytes in msgpack, never pickled) and each tensor's byte
offset there. The engine maps each storage once per version (the mapping is the
expensive part; torch caches it per allocation) and copies every tensor straight into
its staging slot, so an update moves each byte once. Tensors that are not on this GPU
(e.g. a CPU export) are first copied to it and shared the same way.

Lifetime: the engine synchronizes its copies before it answers a bucket, and the trainer
keeps every shared tensor alive until the version is committed or aborted, so no
storage is freed while the engine may read it. The engine drops its mappings when the
version ends (commit or abort), which lets the trainer's allocator reuse that memory.
"""

from __future__ import annotations

from typing import Any

import torch

from miles.core.errors import SyncError
from miles.core.schema.sync import SyncConfig
from miles.transport.bulk.base import BulkReceiver, BulkSender, Layout, LocalWeights, dtype_of
from miles.transport.bulk.buckets import CHUNK_SEP, Bucket

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
        self._shared: dict[tuple[int, int], int] = {}  # (storage address, size) -> index in this version
        self._handles: list[dict[str, Any]] = []
        self._keep: list[torch.Tensor] = []  # one tensor per shared storage the engines may still read
        self._version: int | None = None

    async def open(self, peers: list[str]) -> list[dict[str, Any]]:
        self.peers = list(peers)
        return [{"device": self.device.index} for _ in peers]

    def _begin(self, version: int) -> None:
        if self._version != version:
            self._release()
            self._version = version

    def _release(self) -> None:
        self._shared, self._handles, self._keep, self._version = {}, [], [], None

    def prepare(self, version: int, seq: int, bucket: Bucket) -> dict[str, Any]:
        self._begin(version)
        new: list[dict[str, Any]] = []  # handles this bucket introduces (the engine keeps earlier ones)
        refs = []
        for t in bucket.tensors:
            if t.device != self.device:
                t = t.to(self.device)
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            idx = self._shared.get(key)
            if idx is None:
                self._keep.append(t)  # holds the storage until the version ends
                idx = self._shared[key] = len(self._handles)
                h = dict(zip(_HANDLE_KEYS, st._share_cuda_(), strict=True))
                self._handles.append(h)
                new.append(h)
            refs.append([idx, t.storage_offset() * t.element_size()])
        # The engine reads on its own stream in another process: the bytes must be final now.
        torch.cuda.current_stream(self.device).synchronize()
        return {"version": version, "layout": Layout.of(bucket).to_wire(), "storages": new,
                "first": len(self._handles) - len(new), "refs": refs}

    async def transmit(self) -> None:
        """Nothing moves here: the engine copies from the shared storages once it has the header."""

    async def committed(self, version: int) -> None:
        self._release()

    async def abort(self, version: int) -> None:
        self._release()

    async def close(self) -> None:
        self.peers = []
        self._release()


class CudaIpcReceiver(BulkReceiver):
    tag = "cuda_ipc"

    def __init__(self, info: dict[str, Any], bucket_bytes: int) -> None:
        _need_cuda()
        super().__init__(info, bucket_bytes)
        self._maps: list[torch.UntypedStorage] = []
        self._version: int | None = None

    def _map(self, header: dict[str, Any]) -> None:
        try:
            version = int(header["version"])
            first = int(header["first"])
            fresh = [tuple(h[k] for k in _HANDLE_KEYS) for h in header["storages"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise SyncError(f"cuda_ipc bucket header is malformed: {exc}") from exc
        if version != self._version:  # a new version shares its storages afresh
            self._maps, self._version = [], version
        if first != len(self._maps):
            raise SyncError(f"cuda_ipc: bucket introduces storage #{first}, engine holds {len(self._maps)} "
                            "(a bucket of this version was missed)")
        for fields in fresh:
            try:
                self._maps.append(torch.UntypedStorage._new_shared_cuda(*fields))
            except RuntimeError as exc:
                raise SyncError(f"cuda_ipc: mapping the trainer's storage failed: {exc}") from exc

    async def recv(self, header: dict[str, Any], local: LocalWeights) -> list[tuple[str, torch.Tensor]]:
        lay = Layout.from_wire(header.get("layout", {}))
        self._map(header)
        refs = header.get("refs")
        if not isinstance(refs, list) or len(refs) != len(lay.names):
            raise SyncError(f"cuda_ipc bucket header: {len(lay.names)} tensors but refs {refs!r:.80}")
        out: list[tuple[str, torch.Tensor]] = []
        for name, dt_s, shape, ref in zip(lay.names, lay.dtypes, lay.shapes, refs, strict=True):
            idx, off = int(ref[0]), int(ref[1])
            if not 0 <= idx < len(self._maps):
                raise SyncError(f"cuda_ipc: tensor {name!r} refers to unknown storage #{idx}")
            storage, dt = self._maps[idx], dtype_of(dt_s)
            numel = 1
            for s in shape:
                numel *= int(s)
            if off + numel * dt.itemsize > storage.nbytes():
                raise SyncError(f"cuda_ipc: tensor {name!r} ({numel * dt.itemsize} bytes at {off}) lies "
                                f"outside its shared storage of {storage.nbytes()} bytes")
            src = torch.empty(0, dtype=dt, device=storage.device)
            src.set_(storage, off // dt.itemsize, list(shape))
            dst = _slot(name, local, src)
            dst.copy_(src, non_blocking=True)
            out.append((name, dst))
        # The trainer may reuse its memory once this bucket is answered: the copies must be done.
        torch.cuda.current_stream(self._maps[0].device if self._maps else None).synchronize()
        return out

    def release(self) -> None:
        """The version ended: unmap the trainer's storages so it can free them."""
        self._maps, self._version = [], None

    async def close(self) -> None:
        self.release()


def _slot(name: str, local: LocalWeights, src: torch.Tensor) -> torch.Tensor:
    """The engine's staging slot for `name` when it has one on the same device, else a fresh tensor
    (a chunk of a larger tensor, reassembled by the engine)."""
    if local.slot is not None and CHUNK_SEP not in name:
        try:
            dst = local.slot(name)
        except Exception:  # noqa: BLE001 - no slot of its own: fall back to a fresh tensor
            dst = None
        if dst is not None and dst.device == src.device and dst.shape == src.shape and dst.dtype == src.dtype:
            return dst
    return torch.empty_like(src)
