"""Per-tensor delta encoding for `disk_delta`: XOR against the previous bytes, then compression.

Encodings name the transform and the compressor: `same` (no bytes: unchanged),
`xor+<c>` (XOR with the base, compressed by c), `full+<c>` (the bytes themselves). The
compressor is sync.delta_compression's (`auto` = lz4 when installed, else zlib, sampled);
`raw` is kept whenever compression would not shrink the bytes, and under `*_sampled`
whenever a sample shows it would save too little to pay for itself (dense float changes
barely compress). An entry that will not be compressed goes as `full+raw` even with a base:
an uncompressed XOR is as large as the bytes and costs a pass more on each side (the XOR
itself, and the receiver's XOR instead of a copy), the largest share of a sparse update's
byte work on a CPU host (bench/results/weight_sync_disk_delta_cpu_s15.txt).
"""

from __future__ import annotations

import warnings
import zlib
from types import ModuleType

import numpy as np
import torch
import xxhash

from miles.core.errors import SyncError
from miles.core.schema.sync import DeltaCompression


def _lz4() -> ModuleType | None:
    try:
        import lz4.frame
    except ImportError:
        return None
    return lz4.frame


def pick_compressor(choice: DeltaCompression) -> tuple[str, bool]:
    """`sync.delta_compression` (resolved when its section was built: core/schema/sync.py) as
    (compressor this process uses, whether a sample gates each entry's compression)."""
    name, _, sampled = choice.partition("_")
    if name not in ("lz4", "zlib", "none"):
        raise SyncError(f"sync.delta_compression={choice!r} is not resolved (core/schema/sync.py)")
    if name == "lz4" and _lz4() is None:
        raise SyncError(f"sync.delta_compression={choice!r} but the lz4 package is not installed (pip install lz4)")
    return ("raw" if name == "none" else name), sampled == "sampled"


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous CPU tensor (bf16 as its 16-bit words)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def digest(b: torch.Tensor) -> str:
    """128-bit XXH3 of the bytes: ~4x the speed of xxh64 here (29 vs 7 GB/s on one core), so the
    sender can hash every entry to find the unchanged ones without comparing their bytes."""
    return xxhash.xxh3_128(b.numpy().data).hexdigest()


# `*_sampled` compresses an entry only when a sample of it shrinks at least this much: a slow
# compressor (zlib runs at ~0.05-0.1 GB/s) saving a quarter of the bytes loses to any disk.
# 16 KiB: lz4 took 0.25-0.45 ms per 64 KiB sample on the 2-core CPU host, ~10 % of a 64 MiB
# update's time when half its tensors change (bench/results/weight_sync_disk_delta_cpu_s17.txt).
SAMPLE_BYTES = 1 << 14
AUTO_MAX_RATIO = 0.5


def _worth_compressing(compressor: str, data: torch.Tensor) -> bool:
    """The `auto` gate: whether the leading `SAMPLE_BYTES` of `data` shrink enough to pay."""
    sample = data[:SAMPLE_BYTES].numpy().data
    return len(_compress(compressor, sample)) <= AUTO_MAX_RATIO * len(sample)


def _compress(compressor: str, data: memoryview) -> bytes:
    lz4 = _lz4() if compressor == "lz4" else None
    return lz4.compress(data) if lz4 is not None else zlib.compress(data, 1)


def encode(new: torch.Tensor, old: torch.Tensor | None, compressor: str,
           sample_gate: bool = False, scratch: torch.Tensor | None = None) -> tuple[str, bytes | memoryview]:
    """Encode the uint8 bytes `new` against `old` (same length) or from scratch.

    With `sample_gate` (the `*_sampled` choices), compression is tried only when a leading sample
    (of the XOR, with a base) compresses to at most `AUTO_MAX_RATIO` of its size. An entry
    left uncompressed is `full+raw`, a view of `new` (see the module doc); `same` is found
    only on the way to compressing (the disk_delta sender finds unchanged entries by digest
    first). `scratch` (uint8, at least as long as `new`) receives the XOR instead of a fresh
    tensor: a fresh large tensor is fresh pages, whose first-touch faults cost as much as the
    XOR itself; a payload then may view `scratch`, valid until its next use.
    """
    if old is not None:
        if old.numel() != new.numel():
            raise SyncError(f"delta base has {old.numel()} bytes, new tensor {new.numel()}")
        if compressor == "raw" or (sample_gate and new.numel() > SAMPLE_BYTES and not _worth_compressing(
                compressor, torch.bitwise_xor(new[:SAMPLE_BYTES], old[:SAMPLE_BYTES]))):
            return "full+raw", new.numpy().data
        if scratch is not None and scratch.numel() >= new.numel():
            payload = torch.bitwise_xor(new, old, out=scratch[:new.numel()])
        else:
            payload = torch.bitwise_xor(new, old)
        if not payload.any():
            return "same", b""
        kind = "xor"
    else:
        payload = new
        kind = "full"
    raw = payload.numpy().data
    if compressor == "raw":
        return f"{kind}+raw", raw
    if sample_gate and len(raw) > SAMPLE_BYTES and kind == "full" and not _worth_compressing(compressor, payload):
        return f"{kind}+raw", raw
    packed = _compress(compressor, raw)
    if len(packed) >= len(raw):
        return f"{kind}+raw", raw
    return f"{kind}+{compressor}", packed


def decode(encoding: str, payload: memoryview, base: torch.Tensor | None, nbytes: int, where: str,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild the new uint8 bytes from one encoded entry into `out` (a contiguous uint8
    tensor of `nbytes`, e.g. the engine's staging slot) or a fresh tensor; returns it."""
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8)
    elif out.dtype != torch.uint8 or out.numel() != nbytes or not out.is_contiguous():
        raise SyncError(f"{where}: decode target must be {nbytes} contiguous bytes")
    kind, _, comp = encoding.partition("+")
    if kind == "same":
        if base is None or base.numel() != nbytes:
            raise SyncError(f"{where}: encoding 'same' needs a {nbytes}-byte base tensor")
        return out.copy_(base)
    try:
        if comp == "raw":
            data: bytes | memoryview = payload
        elif comp == "zlib":
            data = zlib.decompress(payload)
        elif comp == "lz4":
            lz4 = _lz4()
            if lz4 is None:
                raise SyncError(f"{where}: delta is lz4-compressed but lz4 is not installed here")
            data = lz4.decompress(payload)
        else:
            raise SyncError(f"{where}: unknown delta encoding {encoding!r}")
    except (zlib.error, RuntimeError, ValueError) as exc:
        raise SyncError(f"{where}: corrupt delta, decompression failed: {exc}") from exc
    if len(data) != nbytes:
        raise SyncError(f"{where}: delta decodes to {len(data)} bytes, index says {nbytes}")
    with warnings.catch_warnings():  # a read-only source, only ever read from
        warnings.simplefilter("ignore", UserWarning)
        src = torch.from_numpy(np.frombuffer(data, dtype=np.uint8)) if nbytes else out
        if kind == "xor":
            if base is None or base.numel() != nbytes:
                raise SyncError(f"{where}: XOR delta needs a {nbytes}-byte base tensor")
            torch.bitwise_xor(src, base, out=out)
        elif kind == "full":
            out.copy_(src)
        else:
            raise SyncError(f"{where}: unknown delta encoding {encoding!r}")
    return out
