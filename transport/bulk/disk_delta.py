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
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from miles.core.errors import MilesError, SyncError
from miles.core.logging import get_logger
from miles.core.schema.sync import SyncConfig
from miles.transport.bulk.base import BulkReceiver, BulkSender, LocalWeights, SenderPlace
from miles.transport.bulk.buckets import CHUNK_SEP, Bucket
from miles.transport.bulk.delta_codec import as_bytes, decode, digest, encode, pick_compressor

log = get_logger("miles.bulk.disk_delta")
INDEX = "index.json"


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
        if self._bucket is None or self._tmp is None:
            raise SyncError("disk_delta: transmit before prepare")
        seq, bucket = self._bucket
        self._bucket = None
        entries = await asyncio.to_thread(self._write_bucket, self._tmp / f"bucket_{seq}.bin", bucket)
        self._index["buckets"][str(seq)] = entries

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
        for v in keep[self.cfg.delta_keep:]:
            shutil.rmtree(version_dir(self.root, v), ignore_errors=True)

    async def abort(self, version: int) -> None:
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


class DiskDeltaReceiver(BulkReceiver):
    tag = "disk_delta"

    def __init__(self, info: dict[str, Any], bucket_bytes: int) -> None:
        super().__init__(info, bucket_bytes)
        if "dir" not in info:
            raise SyncError("disk_delta open info lacks 'dir'")
        self.root = Path(str(info["dir"]))
        self._index: dict[str, Any] | None = None
        self._buf = torch.empty(0, dtype=torch.uint8)  # one bucket file's bytes, reused

    def _load_index(self, version: int) -> dict[str, Any]:
        if self._index is None or self._index.get("version") != version:
            path = version_dir(self.root, version) / INDEX
            try:
                self._index = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise SyncError(f"disk_delta v{version}: cannot read {path}: {exc}") from exc
        return self._index

    async def recv(self, header: dict[str, Any], local: LocalWeights) -> list[tuple[str, torch.Tensor]]:
        return await asyncio.to_thread(self._recv, int(header["version"]), int(header["seq"]), local)

    def _read(self, path: Path, where: str) -> memoryview:
        """The whole file, read into the reused buffer (grown when a file is larger)."""
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if self._buf.numel() < size:
                    self._buf = torch.empty(size, dtype=torch.uint8)
                view = self._buf.numpy().data[:size]
                got = 0
                while got < size:
                    n = f.readinto(view[got:])
                    if not n:
                        raise SyncError(f"{where}: {path.name} ended after {got} of {size} bytes")
                    got += n
        except OSError as exc:
            raise SyncError(f"{where}: cannot read {path}: {exc}") from exc
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
        blob = self._read(path, where=f"disk_delta v{version}")
        out = []
        for e in entries:
            where = f"disk_delta v{version} {e['name']!r}"
            old = _base_slice(e["name"], self.bucket_bytes, local)[1] if base is not None else None
            if e["offset"] + e["length"] > len(blob):
                raise SyncError(f"{where}: entry runs past the end of {path.name}")
            slot = _slot(e, local)  # patch straight into the engine's staging slot when it offers one
            new = decode(e["encoding"], blob[e["offset"]:e["offset"] + e["length"]], old, e["nbytes"], where,
                         None if slot is None else as_bytes(slot))
            if "xxh3" not in e:
                raise SyncError(f"{where}: index entry has no xxh3 digest (written by another miles version?)")
            if e["encoding"] != "same" and digest(new) != e["xxh3"]:  # `same`: our own checked bytes
                raise SyncError(f"{where}: checksum mismatch after patching (corrupt delta); refused")
            out.append((e["name"], slot if slot is not None else
                        new.view(getattr(torch, e["dtype"])).reshape(e["shape"])))
        return out
