"""Per-tensor delta encoding for `disk_delta`: XOR against the previous bytes, then compression.

Encodings name the transform and the compressor: `same` (no bytes: unchanged),
`xor+<c>` (XOR with the base, compressed by c), `full+<c>` (no base). The
compressor is lz4 when installed, else zlib; `raw` is kept whenever compression
would not shrink the bytes (dense float changes barely compress).
"""

from __future__ import annotations

import zlib
from types import ModuleType

import numpy as np
import torch
import xxhash

from miles.core.errors import SyncError


def _lz4() -> ModuleType | None:
    try:
        import lz4.frame
    except ImportError:
        return None
    return lz4.frame  # type: ignore[no-any-return]


def pick_compressor(choice: str) -> str:
    """Resolve `sync.delta_compression` to the compressor this process can use."""
    if choice == "auto":
        return "lz4" if _lz4() is not None else "zlib"
    if choice == "lz4" and _lz4() is None:
        raise SyncError("sync.delta_compression='lz4' but the lz4 package is not installed (pip install lz4)")
    if choice not in ("zlib", "lz4", "none"):
        raise SyncError(f"unknown delta compression {choice!r}; valid: auto, zlib, lz4, none")
    return "raw" if choice == "none" else choice


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous CPU tensor (bf16 as its 16-bit words)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def digest(b: torch.Tensor) -> str:
    return xxhash.xxh64(b.numpy()).hexdigest()


def encode(new: torch.Tensor, old: torch.Tensor | None, compressor: str) -> tuple[str, bytes | memoryview]:
    """Encode the uint8 bytes `new` against `old` (same length) or from scratch."""
    if old is not None:
        if old.numel() != new.numel():
            raise SyncError(f"delta base has {old.numel()} bytes, new tensor {new.numel()}")
        if torch.equal(old, new):
            return "same", b""
        payload = torch.bitwise_xor(new, old)
        kind = "xor"
    else:
        payload = new
        kind = "full"
    raw = memoryview(payload.numpy())
    if compressor == "raw":
        return f"{kind}+raw", raw
    lz4 = _lz4() if compressor == "lz4" else None
    packed = lz4.compress(raw) if lz4 is not None else zlib.compress(raw, 1)
    if len(packed) >= len(raw):
        return f"{kind}+raw", raw
    return f"{kind}+{compressor}", packed


def decode(encoding: str, payload: memoryview, base: torch.Tensor | None, nbytes: int, where: str) -> torch.Tensor:
    """Rebuild the new uint8 bytes (a fresh tensor) from one encoded entry."""
    kind, _, comp = encoding.partition("+")
    if kind == "same":
        if base is None:
            raise SyncError(f"{where}: encoding 'same' without a base tensor")
        return base.clone()
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
    out = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
    if kind == "xor":
        if base is None or base.numel() != nbytes:
            raise SyncError(f"{where}: XOR delta needs a {nbytes}-byte base tensor")
        torch.bitwise_xor(out, base, out=out)
    elif kind != "full":
        raise SyncError(f"{where}: unknown delta encoding {encoding!r}")
    return out
