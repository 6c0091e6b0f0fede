"""Fixed-size weight buckets: pack (name, tensor) streams into buckets, splitting large tensors."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from miles.core.errors import SyncError

CHUNK_SEP = "#chunk"


@dataclass
class Bucket:
    """One bucket: parallel lists of names and flat-or-shaped tensors, with its byte size."""

    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Yield buckets of at most `bucket_bytes`; a larger tensor is split into flat chunks.

    A chunk is named `<name>#chunk<i>/<n>/<shape>` so the receiver can reassemble it.
    """
    if bucket_bytes <= 0:
        raise SyncError(f"bucket size must be positive, got {bucket_bytes} bytes")
    cur = Bucket()
    for name, t in named:
        t = t.detach().contiguous()
        size = t.numel() * t.element_size()
        if size > bucket_bytes:
            if cur.names:
                yield cur
                cur = Bucket()
            flat = t.reshape(-1)
            per = max(1, bucket_bytes // t.element_size())
            n = (flat.numel() + per - 1) // per
            shape = "x".join(map(str, t.shape))
            for i in range(n):
                piece = flat[i * per:(i + 1) * per]
                yield Bucket([f"{name}{CHUNK_SEP}{i}/{n}/{shape}"], [piece], piece.numel() * t.element_size())
            continue
        if cur.nbytes + size > bucket_bytes and cur.names:
            yield cur
            cur = Bucket()
        cur.names.append(name)
        cur.tensors.append(t)
        cur.nbytes += size
    if cur.names:
        yield cur


class Reassembler:
    """Receiver side: turns chunked names back into whole tensors once every chunk arrived."""

    def __init__(self) -> None:
        self._parts: dict[str, dict[int, torch.Tensor]] = {}

    def add(self, name: str, t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if CHUNK_SEP not in name:
            return name, t
        base, _, spec = name.partition(CHUNK_SEP)
        try:
            idx_s, n_s, shape_s = spec.split("/")
            idx, n = int(idx_s), int(n_s)
            shape = [int(x) for x in shape_s.split("x")] if shape_s else []
        except ValueError as exc:
            raise SyncError(f"malformed chunk name {name!r}") from exc
        parts = self._parts.setdefault(base, {})
        parts[idx] = t.clone()
        if len(parts) < n:
            return None
        del self._parts[base]
        whole = torch.cat([parts[i] for i in range(n)])
        return base, whole.reshape(shape)

    def incomplete(self) -> list[str]:
        return sorted(self._parts)
