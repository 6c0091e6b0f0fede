"""`cuda_ipc` channel: trainer and engine share one GPU; the engine copies from the trainer's memory.

Single copy: the header of a bucket carries the CUDA IPC handle of each trainer storage
its tensors live in (ints and bytes in msgpack, never pickled) and, per run of tensors
lying back to back there, the run's byte offset. The engine maps each storage once per
version (the mapping is the expensive part; torch caches it per allocation) and copies
straight into its staging slots: one copy per run when its slots are laid out like the
bucket (a trainer holding its weights in one flat buffer sends a bucket as one copy),
else one per tensor. An update moves each byte once. Tensors that are not on this GPU
(e.g. a CPU export) are first copied to it and shared the same way.

Lifetime: the engine's copies run asynchronously on its stream, and it synchronizes them
(`settle`) before it answers the commit, after which the trainer may change or free its
memory, and before it unmaps anything; the trainer keeps every shared
tensor alive until the version is committed or aborted. The engine drops its mappings
when the version ends (commit or abort), which lets the trainer's allocator reuse that
memory. (An aborted version's copies may still read memory the trainer reuses: they land
in staging the engine drops.)

Flat exports (weightsync/flat.py): the trainer's flat buffer persists across versions,
so it is shared once per channel and mapped once by each engine, which keeps the mapping
until the buffer changes or the channel closes. A bucket is then a header of four ints
and one copy; the trainer synchronizes once per version and the engine once, at commit
(its host-side swap overlaps the last copies: generation runs on the same stream).
"""

from __future__ import annotations

from typing import Any

import torch

from miles.core.errors import MilesError, SyncError
from miles.core.schema.sync import SyncConfig
from miles.transport.bulk.base import (
    BulkReceiver,
    BulkSender,
    Layout,
    LocalWeights,
    SenderPlace,
    dtype_of,
    slot_region,
)
from miles.transport.bulk.buckets import CHUNK_SEP, Bucket
from miles.transport.bulk.wire_plan import runs_of

_HANDLE_KEYS = ("device", "handle", "size", "offset", "ref_handle", "ref_offset", "event", "event_sync")


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        raise SyncError("sync.transport='cuda_ipc' needs CUDA (trainer and engine on one GPU); "
                        "none is available in this process")


class CudaIpcSender(BulkSender):
    tag = "cuda_ipc"
    flat = True
    flat_window = 1 << 20  # a range's header is four ints: nothing to free between ranges

    def __init__(self, cfg: SyncConfig, place: SenderPlace | None = None) -> None:
        _need_cuda()
        super().__init__(cfg, place)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._shared: dict[tuple[int, int], int] = {}  # (storage address, size) -> index in this version
        self._handles: list[dict[str, Any]] = []
        self._keep: list[torch.Tensor] = []  # one tensor per shared storage the engines may still read
        self._version: int | None = None
        # Flat exports: the buffer shared with the engines (kept alive while they map it), its
        # share id and handle, whether this channel's receivers got the handle, the last synced version.
        self._flat: tuple[tuple[int, int], torch.Tensor, int, dict[str, Any]] | None = None
        self._flat_sent = False
        self._flat_version: int | None = None

    async def open(self, peers: list[str], shared: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.peers = list(peers)
        self._flat_sent = False  # fresh receivers map the flat buffer afresh
        return [{"device": self.device.index} for _ in peers]

    def prepare_flat(self, version: int, seq: int, lo: int, hi: int, weights: Any) -> dict[str, Any]:
        buf: torch.Tensor = weights.buffer
        if buf.device != self.device:
            raise SyncError(f"cuda_ipc: the flat export lies on {buf.device}, this trainer shares {self.device}")
        if self._flat_version != version:
            # The engine reads on its own stream in another process: the bytes must be final now.
            torch.cuda.current_stream(self.device).synchronize()
            self._flat_version = version
        st = buf.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if self._flat is None or self._flat[0] != key:
            sid = self._flat[2] + 1 if self._flat is not None else 1
            self._flat = (key, buf, sid, dict(zip(_HANDLE_KEYS, st._share_cuda_(), strict=True)))
            self._flat_sent = False
        _, _, sid, handle = self._flat
        header = {"sid": sid, "base": buf.storage_offset(), "lo": lo, "hi": hi,
                  "storage": None if self._flat_sent else handle}
        self._flat_sent = True
        return header

    def _begin(self, version: int) -> None:
        if self._version != version:
            self._release()
            self._version = version

    def _release(self) -> None:
        self._shared, self._handles, self._keep, self._version = {}, [], [], None

    def prepare(self, version: int, seq: int, bucket: Bucket) -> dict[str, Any]:
        self._begin(version)
        new: list[dict[str, Any]] = []  # handles this bucket introduces (the engine keeps earlier ones)
        tensors = [t if t.device == self.device else t.to(self.device) for t in bucket.tensors]
        runs = []
        for a, b in runs_of(tensors):  # tensors back to back in one storage travel as one copy
            t = tensors[a]
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            idx = self._shared.get(key)
            if idx is None:
                self._keep.append(t)  # holds the storage until the version ends
                idx = self._shared[key] = len(self._handles)
                h = dict(zip(_HANDLE_KEYS, st._share_cuda_(), strict=True))
                self._handles.append(h)
                new.append(h)
            runs.append([idx, t.storage_offset() * t.element_size(), a, b])
        # The engine reads on its own stream in another process: the bytes must be final now.
        torch.cuda.current_stream(self.device).synchronize()
        return {"version": version, "layout": Layout.of(bucket).to_wire(), "storages": new,
                "first": len(self._handles) - len(new), "runs": runs}

    async def transmit(self) -> None:
        """Nothing moves here: the engine copies from the shared storages once it has the header."""

    async def committed(self, version: int) -> None:
        self._release()

    async def abort(self, version: int) -> None:
        self._release()

    async def close(self) -> None:
        self.peers = []
        self._release()
        self._flat, self._flat_sent, self._flat_version = None, False, None


class CudaIpcReceiver(BulkReceiver):
    tag = "cuda_ipc"

    def __init__(self, info: dict[str, Any], bucket_bytes: int) -> None:
        _need_cuda()
        # `_new_shared_cuda` does not initialise CUDA itself (torch's own rebuild of a shared CUDA
        # tensor calls `_lazy_init` first). In a process whose first CUDA call is the mapping (an
        # SGLang engine role: it runs no model) it died of SIGSEGV at the first push (session 17,
        # H100; the dense 1.3B SGLang case of session 12 died the same way).
        torch.cuda.init()
        super().__init__(info, bucket_bytes)
        self._maps: list[torch.UntypedStorage] = []
        self._version: int | None = None
        self._flat: tuple[int, torch.UntypedStorage] | None = None  # (share id, mapping) of a flat export
        self._pending: torch.device | None = None  # where copies may still run (synchronized by `settle`)

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
        runs = _runs(header, len(lay.names), len(self._maps))
        ends = [*lay.offsets[1:], lay.nbytes]
        dev = self._maps[0].device if self._maps else torch.device("cuda")
        region = slot_region(lay, local, dev)  # the engine's slots, laid out like this bucket
        out: list[tuple[str, torch.Tensor]] = []
        for idx, off, a, b in runs:
            n = ends[b - 1] - lay.offsets[a]
            src = self._bytes(idx, off, n, lay.names[a])
            if region is not None:  # one copy per run, straight into the staging slots
                region[lay.offsets[a]:ends[b - 1]].copy_(src, non_blocking=True)
                continue
            for i in range(a, b):  # per tensor: into its slot, or a fresh tensor (chunks)
                lo, hi = lay.offsets[i] - lay.offsets[a], ends[i] - lay.offsets[a]
                t = src[lo:hi].view(dtype_of(lay.dtypes[i])).view(lay.shapes[i])
                dst = _slot(lay.names[i], local, t)
                dst.copy_(t, non_blocking=True)
                out.append((lay.names[i], dst))
        if region is not None and local.slot is not None:
            out = [(n, local.slot(n)) for n in lay.names]
        self._pending = dev
        return out

    async def recv_flat(self, header: dict[str, Any], landing: Any, local: LocalWeights) -> list[str]:
        try:
            sid, base, lo, hi = (int(header[k]) for k in ("sid", "base", "lo", "hi"))
            fresh = header["storage"]
            fields = None if fresh is None else tuple(fresh[k] for k in _HANDLE_KEYS)
        except (KeyError, TypeError, ValueError) as exc:
            raise SyncError(f"cuda_ipc flat header is malformed: {type(exc).__name__}: {exc}") from exc
        if fields is not None:
            try:
                self._flat = (sid, torch.UntypedStorage._new_shared_cuda(*fields))
            except RuntimeError as exc:
                raise SyncError(f"cuda_ipc: mapping the trainer's flat buffer failed: {exc}") from exc
        if self._flat is None or self._flat[0] != sid:
            raise SyncError(f"cuda_ipc flat range refers to shared buffer #{sid}, this engine maps "
                            f"#{self._flat[0] if self._flat else None} (its handle was missed)")
        storage = self._flat[1]
        if base + hi > storage.nbytes():
            raise SyncError(f"cuda_ipc: flat range [{lo}, {hi}) at {base} lies outside the shared buffer "
                            f"of {storage.nbytes()} bytes")
        src = torch.empty(0, dtype=torch.uint8, device=storage.device)
        src.set_(storage, base + lo, (hi - lo,), (1,))
        names: list[str] = landing.land(lo, hi, src, local)
        self._pending = storage.device
        return names

    async def settle(self) -> None:
        """Wait for this version's copies (the trainer may reuse its memory once answered)."""
        if self._pending is not None:
            torch.cuda.current_stream(self._pending).synchronize()
            self._pending = None

    def _bytes(self, idx: int, off: int, n: int, name: str) -> torch.Tensor:
        storage = self._maps[idx]
        if off + n > storage.nbytes():
            raise SyncError(f"cuda_ipc: {n} bytes at {off} (from {name!r}) lie outside the shared storage "
                            f"of {storage.nbytes()} bytes")
        src = torch.empty(0, dtype=torch.uint8, device=storage.device)
        return src.set_(storage, off, (n,), (1,))

    def release(self) -> None:
        """The version ended: unmap the trainer's storages so it can free them."""
        self._maps, self._version = [], None

    async def close(self) -> None:
        self.release()
        self._flat = None


def _runs(header: dict[str, Any], ntensors: int, nmaps: int) -> list[tuple[int, int, int, int]]:
    try:
        runs = [(int(r[0]), int(r[1]), int(r[2]), int(r[3])) for r in header["runs"]]
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise SyncError(f"cuda_ipc bucket header is malformed: {exc}") from exc
    if [i for _, _, a, b in runs for i in range(a, b)] != list(range(ntensors)):
        raise SyncError(f"cuda_ipc bucket header: runs {[(a, b) for _, _, a, b in runs]} do not cover "
                        f"its {ntensors} tensors in order")
    bad = [i for i, _, _, _ in runs if not 0 <= i < nmaps]
    if bad:
        raise SyncError(f"cuda_ipc bucket header refers to unknown storage(s) {bad}")
    return runs


def _slot(name: str, local: LocalWeights, src: torch.Tensor) -> torch.Tensor:
    """The engine's staging slot for `name` when it has one on the same device, else a fresh tensor
    (a chunk of a larger tensor, reassembled by the engine)."""
    if local.slot is not None and CHUNK_SEP not in name:
        try:
            dst = local.slot(name)
        except MilesError:  # no slot of its own: a fresh tensor
            dst = None
        if dst is not None and dst.device == src.device and dst.shape == src.shape and dst.dtype == src.dtype:
            return dst
    return torch.empty_like(src)
