"""`disk_delta` channel: changed bytes per tensor, written atomically to a shared directory.

The trainer writes `weight_v{N}.tmp-*/bucket_{i}.bin` plus `index.json` (version, base
version, per-entry encoding, offsets, XXH3-128 of the rebuilt bytes), then renames the
directory to `weight_v{N}/` so readers never see a partial version. Engines read
after the rename, patch their live copy (which must be the base version) and refuse
any entry whose rebuilt bytes do not match the index checksum.

Both sides keep their working memory across versions (the sender's copy of the last
version and its spare, the XOR scratch, the receiver's read buffer): a fresh large tensor
is fresh pages, and faulting them in cost as much as the copy into them (measured:
bench/results/weight_sync_disk_delta_cpu.txt). An unchanged entry (`same`) costs no hash
on either side: the sender reuses the last version's digest, and the receiver copies its
own live bytes, which were checked when they arrived. The sender finds the unchanged entries
by that digest (equal to the last version's: `same`, with no XOR pass over its bytes; a
128-bit hash, so a changed tensor passing for unchanged is a 2^-128 event).

Off the push's path: the sender writes bucket files on one writer thread while the coordinator
packs the next bucket (`finish` waits for them), and deletes versions past `sync.delta_keep`
beside the next push; the receiver reads an uncompressed entry straight from its file into the
staging slot, hashing each chunk as it lands, and reads bucket k+1 ahead while bucket k is
staged (bench/results/weight_sync_disk_delta_cpu_s17.txt).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash

from miles.core.errors import MilesError, SyncError
from miles.core.logging import get_logger
from miles.core.schema.sync import SyncConfig
from miles.transport.bulk.base import BulkReceiver, BulkSender, LocalWeights, SenderPlace
from miles.transport.bulk.buckets import CHUNK_SEP, Bucket
from miles.transport.bulk.delta_codec import as_bytes, decode, digest, encode, pick_compressor

log = get_logger("miles.bulk.disk_delta")
INDEX = "index.json"
# The receiver reads an uncompressed entry in chunks this size, hashing each while it is in cache.
_READ_CHUNK = 1 << 20


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"weight_v{version}"


def _base_slice(name: str, bucket_bytes: int, local: LocalWeights) -> tuple[str, torch.Tensor]:
    """The bytes of the engine's live tensor that entry `name` (maybe a chunk) replaces."""
    base_name, _, spec = name.partition(CHUNK_SEP)
    whole = as_bytes(local.get(base_name))
    if not spec:
        return base_name, whole
    idx = int(spec.split("/")[0])
    per = bucket_bytes // local.get(base_name).element_size() * local.get(base_name).element_size()
    return base_name, whole[idx * per:(idx + 1) * per]


def _slot(entry: dict[str, Any], local: LocalWeights) -> torch.Tensor | None:
    """The engine's staging slot for a whole-tensor entry of matching dtype and shape."""
    if local.slot is None or CHUNK_SEP in entry["name"]:
        return None
    try:
        s = local.slot(entry["name"])
    except MilesError:
        return None
    ok = (str(s.dtype).removeprefix("torch.") == entry["dtype"] and list(s.shape) == list(entry["shape"])
          and s.is_contiguous() and s.device.type == "cpu")
    return s if ok else None


def _remove(dirs: list[Path]) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


class DiskDeltaSender(BulkSender):
    tag = "disk_delta"
    streaming = False

    def __init__(self, cfg: SyncConfig, place: SenderPlace | None = None) -> None:
        super().__init__(cfg, place)
        if not cfg.delta_dir:
            raise SyncError("disk_delta needs sync.delta_dir (a directory every engine can read)")
        self.root = Path(cfg.delta_dir)
        self.compressor, self.sample_gate = pick_compressor(cfg.delta_compression)
        self.base_version: int | None = None
        self._last: dict[str, torch.Tensor] = {}  # bytes of the last committed version, by entry name
        self._next: dict[str, torch.Tensor] = {}  # bytes of the version being written (changed entries)
        self._spare: dict[str, torch.Tensor] = {}  # buffers free for the next version's bytes, by entry name
        self._sums: dict[str, str] = {}  # digest of each entry's last committed bytes
        self._next_sums: dict[str, str] = {}
        self._scratch = torch.empty(0, dtype=torch.uint8)  # the XOR of one entry, reused
        self._tmp: Path | None = None
        self._index: dict[str, Any] = {}
        self._bucket: tuple[int, Bucket] | None = None
        self._rm: threading.Thread | None = None  # deleting versions past sync.delta_keep
        self._writer: ThreadPoolExecutor | None = None  # writes the bucket files, in order (`transmit`)
        self._writes: list[Future[None]] = []  # its writes of the version being written
        self.written_bytes = 0

    async def open(self, peers: list[str], shared: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.root.mkdir(parents=True, exist_ok=True)
        self.peers = list(peers)
        return [{"dir": str(self.root)} for _ in peers]

    def _begin(self, version: int) -> Path:
        if self._tmp is None:
            self._tmp = self.root / f"weight_v{version}.tmp-{os.getpid()}-{os.urandom(3).hex()}"
            self._tmp.mkdir(parents=True)
            self._index = {"version": version, "base": self.base_version, "compressor": self.compressor,
                           "buckets": {}}
            self._recycle()
            self.written_bytes = 0
        return self._tmp

    def _recycle(self) -> None:
        """Hand the buffers of an uncommitted version back as spares."""
        self._spare.update(self._next)
        self._next, self._next_sums = {}, {}

    def _keep(self, name: str, new: torch.Tensor) -> torch.Tensor:
        """A copy of `new` in a spare buffer of `name` (allocated the first time only)."""
        buf = self._spare.pop(name, None)
        if buf is None or buf.numel() != new.numel():
            buf = torch.empty(new.numel(), dtype=torch.uint8)
        return buf.copy_(new)

    def prepare(self, version: int, seq: int, bucket: Bucket) -> dict[str, Any]:
        self._begin(version)
        self._bucket = (seq, bucket)
        return {"version": version, "seq": seq}

    async def transmit(self) -> None:
        """Queue the bucket's file write on the writer thread and return: the coordinator packs
        the next bucket while this one is written (receivers read only after `finish`, which
        waits for every write). One thread for all of them, in order: a thread hop per bucket
        cost ~2.5 ms of a ~60 ms update on a loaded 2-core host."""
        if self._bucket is None or self._tmp is None:
            raise SyncError("disk_delta: transmit before prepare")
        seq, bucket = self._bucket
        self._bucket = None
        for w in [w for w in self._writes if w.done()]:
            w.result()  # a failed write fails the push now, not at `finish`
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="disk-delta-write")
        path, index = self._tmp / f"bucket_{seq}.bin", self._index["buckets"]
        self._writes.append(self._writer.submit(self._write_into, index, str(seq), path, bucket))

    def _write_into(self, index: dict[str, Any], key: str, path: Path, bucket: Bucket) -> None:
        index[key] = self._write_bucket(path, bucket)

    async def _written(self, check: bool) -> None:
        """Wait for the queued writes; `check`: raise the first failure."""
        writes, self._writes = self._writes, []
        done = await asyncio.gather(*map(asyncio.wrap_future, writes), return_exceptions=True)
        errors = [e for e in done if isinstance(e, BaseException)]
        if check and errors:
            raise errors[0]

    def _write_bucket(self, path: Path, bucket: Bucket) -> list[dict[str, Any]]:
        entries, pos = [], 0
        biggest = max((t.numel() * t.element_size() for t in bucket.tensors), default=0)
        if self._scratch.numel() < biggest:
            self._scratch = torch.empty(biggest, dtype=torch.uint8)
        with open(path, "wb") as f:
            for name, t in zip(bucket.names, bucket.tensors, strict=True):
                new = as_bytes(t.to("cpu"))
                old = self._last.get(name)
                if old is not None and old.numel() != new.numel():
                    old = None
                sum_ = digest(new)
                payload: bytes | memoryview
                if old is not None and self._sums.get(name) == sum_:
                    enc, payload = "same", b""  # the bytes of the base: nothing to XOR, write or keep
                else:
                    enc, payload = encode(new, old, self.compressor, self.sample_gate, self._scratch)
                    f.write(payload)  # before the next entry reuses the scratch a raw payload views
                    if enc != "same":
                        self._next[name] = self._keep(name, new)
                        self._next_sums[name] = sum_
                entries.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."),
                                "shape": list(t.shape), "encoding": enc, "offset": pos,
                                "length": len(payload), "nbytes": new.numel(), "xxh3": sum_})
                pos += len(payload)
        self.written_bytes += pos
        return entries

    async def finish(self, version: int) -> None:
        await self._written(check=True)
        tmp = self._begin(version)
        self._tmp = None
        (tmp / INDEX).write_text(json.dumps(self._index))
        final = version_dir(self.root, version)
        if final.exists():  # left by an aborted attempt at this version
            shutil.rmtree(final)
        os.replace(tmp, final)

    async def committed(self, version: int) -> None:
        for name, buf in self._next.items():
            prev = self._last.get(name)
            self._last[name] = buf
            if prev is not None:
                self._spare[name] = prev
        self._sums.update(self._next_sums)
        self._next, self._next_sums = {}, {}
        self.base_version = version
        keep = sorted((int(p.name.removeprefix("weight_v")) for p in self.root.glob("weight_v*")
                       if p.name.removeprefix("weight_v").isdigit()), reverse=True)
        old = [version_dir(self.root, v) for v in keep[self.cfg.delta_keep:]]
        await self._removed()
        if old:  # off the push's path: freeing a version's page-cache pages took ~8 ms of ~90 per 32 MiB
            self._rm = threading.Thread(target=_remove, args=(old,), name="disk-delta-rm", daemon=True)
            self._rm.start()

    async def _removed(self) -> None:
        """Wait for the previous version's delete, if it still runs (one at a time)."""
        if self._rm is not None:
            await asyncio.to_thread(self._rm.join)
            self._rm = None

    async def abort(self, version: int) -> None:
        await self._written(check=False)  # nothing may still write into the files or buffers dropped here
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        self._recycle()

    def reset_base(self) -> None:
        """Forget the base: the next version is written in full (e.g. after engines restarted)."""
        self._spare.update(self._last)
        self._last, self._sums = {}, {}
        self.base_version = None

    async def close(self) -> None:
        await self.abort(-1)
        await self._removed()
        if self._writer is not None:
            self._writer.shutdown()
            self._writer = None


class DiskDeltaReceiver(BulkReceiver):
    tag = "disk_delta"

    def __init__(self, info: dict[str, Any], bucket_bytes: int) -> None:
        super().__init__(info, bucket_bytes)
        if "dir" not in info:
            raise SyncError("disk_delta open info lacks 'dir'")
        self.root = Path(str(info["dir"]))
        self._index: dict[str, Any] | None = None
        self._buf = torch.empty(0, dtype=torch.uint8)  # one bucket file's bytes, reused
        # The next bucket, read ahead while the engine stages this one and the next ask travels:
        # (version, seq, its entries). Every bucket is on disk before the first ask (`finish`).
        self._ahead: tuple[int, int, Future[list[tuple[str, torch.Tensor]]]] | None = None
        self._reader: ThreadPoolExecutor | None = None

    def _load_index(self, version: int) -> dict[str, Any]:
        if self._index is None or self._index.get("version") != version:
            path = version_dir(self.root, version) / INDEX
            try:
                self._index = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise SyncError(f"disk_delta v{version}: cannot read {path}: {exc}") from exc
        return self._index

    async def recv(self, header: dict[str, Any], local: LocalWeights) -> list[tuple[str, torch.Tensor]]:
        """Bucket `seq` (read ahead at the last ask when it was the next one), then bucket seq+1
        starts reading into its staging slots in the background: on a 64 MiB update the asks
        come one at a time, ~1.5 ms of round trip each besides the read."""
        version, seq = int(header["version"]), int(header["seq"])
        ahead = await self._take_ahead(version, seq)
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="disk-delta-read")
        got = ahead.result() if ahead is not None else await asyncio.wrap_future(
            self._reader.submit(self._recv, version, seq, local))
        index = self._index
        if index is not None and index.get("version") == version and str(seq + 1) in index["buckets"]:
            self._ahead = (version, seq + 1, self._reader.submit(self._recv, version, seq + 1, local))
        return got

    async def _take_ahead(self, version: int, seq: int) -> Future[list[tuple[str, torch.Tensor]]] | None:
        """The finished read-ahead of (version, seq) if it is that bucket's (its error raises when its
        result is taken); another bucket's is waited for and dropped (nothing may still write)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        await asyncio.wait([asyncio.wrap_future(ahead[2])])
        return ahead[2] if ahead[:2] == (version, seq) else None

    async def settle(self) -> None:
        """Before the commit (or an abort): no read-ahead may still write into staging."""
        await self._take_ahead(-1, -1)

    def release(self) -> None:
        self._ahead = None

    async def close(self) -> None:
        await self.settle()
        if self._reader is not None:
            self._reader.shutdown()
            self._reader = None

    def _read_into(self, f: io.FileIO, into: memoryview, what: str) -> str:
        """Read len(into) bytes from f's position into `into`, hashing each chunk as it lands
        (cache-hot) -> the digest of the bytes read."""
        h = xxhash.xxh3_128()
        got, size = 0, len(into)
        while got < size:
            n = f.readinto(into[got:min(got + _READ_CHUNK, size)])
            if not n:
                raise SyncError(f"{what} ended after {got} of {size} bytes")
            h.update(into[got:got + n])
            got += n
        return h.hexdigest()

    def _payload(self, f: io.FileIO, length: int, what: str) -> memoryview:
        """The next `length` bytes of f, read into the reused buffer (grown when needed)."""
        if self._buf.numel() < length:
            self._buf = torch.empty(length, dtype=torch.uint8)
        view = self._buf.numpy().data[:length]
        self._read_into(f, view, what)
        return view

    def _recv(self, version: int, seq: int, local: LocalWeights) -> list[tuple[str, torch.Tensor]]:
        index = self._load_index(version)
        base = index.get("base")
        entries = index["buckets"].get(str(seq))
        if entries is None:
            raise SyncError(f"disk_delta v{version}: index has no bucket {seq}")
        if base is not None and base != local.version:
            raise SyncError(f"disk_delta v{version} is a delta against v{base}, this engine holds "
                            f"v{local.version}; it must catch up with a full version first")
        path = version_dir(self.root, version) / f"bucket_{seq}.bin"
        try:
            with open(path, "rb", buffering=0) as f:
                return self._entries(f, path, version, base, entries, local)
        except OSError as exc:
            raise SyncError(f"disk_delta v{version}: cannot read {path}: {exc}") from exc

    def _entries(self, f: io.FileIO, path: Path, version: int, base: int | None, entries: list[dict[str, Any]],
                 local: LocalWeights) -> list[tuple[str, torch.Tensor]]:
        size = os.fstat(f.fileno()).st_size
        out = []
        for e in entries:
            where = f"disk_delta v{version} {e['name']!r}"
            if "xxh3" not in e:
                raise SyncError(f"{where}: index entry has no xxh3 digest (written by another miles version?)")
            if e["offset"] + e["length"] > size:
                raise SyncError(f"{where}: entry runs past the end of {path.name}")
            slot = _slot(e, local)  # patch straight into the engine's staging slot when it offers one
            target = None if slot is None else as_bytes(slot)
            if e["encoding"] == "full+raw" and e["length"] == e["nbytes"]:
                # the bytes themselves: read from the file straight into their destination, hashed
                # chunk by chunk as they land: no pass through the read buffer, no second pass to hash
                new = target if target is not None else torch.empty(e["nbytes"], dtype=torch.uint8)
                f.seek(e["offset"])
                sum_ = self._read_into(f, new.numpy().data, f"{where}: {path.name}")
            else:
                old = _base_slice(e["name"], self.bucket_bytes, local)[1] if base is not None else None
                f.seek(e["offset"])
                payload = self._payload(f, e["length"], f"{where}: {path.name}")
                new = decode(e["encoding"], payload, old, e["nbytes"], where, target)
                sum_ = e["xxh3"] if e["encoding"] == "same" else digest(new)  # `same`: our own checked bytes
            if sum_ != e["xxh3"]:
                raise SyncError(f"{where}: checksum mismatch after patching (corrupt delta); refused")
            out.append((e["name"], slot if slot is not None else
                        new.view(getattr(torch, e["dtype"])).reshape(e["shape"])))
        return out
