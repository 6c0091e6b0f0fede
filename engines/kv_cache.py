"""KV storage of the torch engine: a row pool for running sequences and an LRU session store.

Running sequences occupy rows 0..n-1 of a preallocated pool (kept compact, so a
decode step reads a plain slice); column `max_seq_len` is a scratch slot where
padded positions write. Idle sessions keep a trimmed copy of their KV in the
session store until `end_session` or LRU eviction under a token budget.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from miles.models.config import ModelSpec

if TYPE_CHECKING:
    from miles.engines.base import GenerateRequest


class KVPool(Protocol):
    """What the engine and its stepper need from a KV pool: the row pool (below) or the paged
    one (engines/paged_kv.py). `reserves` pools admit a request only once `can_take` its
    `request_blocks`; for the row pool, whose rows are all preallocated, the admission hooks
    are no-ops."""

    reserves: bool
    max_seq_len: int  # also the index of the scratch column a prefill writes padding to
    k: list[torch.Tensor]  # per-layer keys (first dim: rows, or blocks); decode graphs read its device

    def bytes_per_token(self) -> int: ...
    def bind(self, r0: int, pos: torch.Tensor, read_len: int) -> None: ...
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def move(self, src: int, dst: int, length: int) -> None: ...
    def share(self, src: int, dst: int, count: int, length: int) -> None: ...
    def export(self, row: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]: ...
    def restore(self, row: int, k: list[torch.Tensor], v: list[torch.Tensor], length: int) -> None: ...
    # admission and accounting
    def check_fits(self, req: GenerateRequest) -> None: ...
    def request_blocks(self, req: GenerateRequest, shared: int = 0) -> int: ...
    def can_take(self, blocks: int) -> bool: ...
    def open(self, row: int, req: GenerateRequest) -> None: ...
    def release(self, row: int) -> None: ...
    def reset(self) -> None: ...
    def prepare(self, r0: int, tops: list[int]) -> None: ...
    def stats(self) -> dict[str, int]: ...


class RowPool:
    """Per-layer K/V tensors [rows, heads, max_seq_len + 1, k_dim / v_dim]; implements `KVCache`.

    (heads, k_dim, v_dim) = `spec.kv_cache_dims`: the K/V heads of GQA attention, or for MLA
    (DeepSeek-V3) one "head" holding the compressed latent (as k) and the shared rotary key
    (as v), which the attention expands per step.
    """

    def __init__(self, spec: ModelSpec, rows: int, max_seq_len: int, dtype: torch.dtype, device: torch.device):
        self.k, self.v = [], []
        for layer in range(spec.num_layers):  # dims may differ per layer (qwen3_next's DeltaNet)
            heads, kd, vd = spec.kv_cache_dims_at(layer)
            self.k.append(torch.zeros((rows, heads, max_seq_len + 1, kd), dtype=dtype, device=device))
            self.v.append(torch.zeros((rows, heads, max_seq_len + 1, vd), dtype=dtype, device=device))
        self.max_seq_len = max_seq_len
        self._r0 = 0
        # head index per distinct head count, [1, heads, 1]: with the rows and positions of `bind`
        # it addresses each written (row, head, position) of the pool tensors themselves
        self._heads = {h: torch.arange(h, device=device)[None, :, None] for h in {c.shape[1] for c in self.k}}
        self._rows = torch.zeros(0, 1, 1, dtype=torch.long, device=device)
        self._at = torch.zeros(0, 1, 1, dtype=torch.long, device=device)
        self._read = 0
        self._col: int | None = None  # `bind_column`: every row writes this one position
        # `bind_column`'s per-layer views of rows r0..r0+n-1 (K, V), kept while (r0, n) holds:
        # a decode hop's steps all cover the same rows
        self._row_views: tuple[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = ((-1, 0), [])

    def bytes_per_token(self) -> int:
        """Cache bytes one token takes over all layers (K and V)."""
        return sum(t[0, :, 0].numel() * t.element_size() for t in (*self.k, *self.v))

    def bind(self, r0: int, pos: torch.Tensor, read_len: int) -> None:
        """The next forward writes rows r0..r0+n-1 at positions pos [n, T] and reads :read_len."""
        n = pos.shape[0]
        self._r0 = r0
        self._rows = torch.arange(r0, r0 + n, device=pos.device)[:, None, None]
        self._at = pos.clamp(max=self.max_seq_len)[:, None, :]
        self._read = read_len
        self._col = None

    def bind_column(self, r0: int, at: int, read_len: int) -> None:
        """`bind` for a decode step whose rows all write position `at` (rows of one length, e.g.
        a batch or group decoding in lockstep): each layer's write is then one slice copy, not
        an index_put_ over built indices (eager CPU decode, where each op costs microseconds;
        decode graphs keep `bind`, whose write positions live on the device)."""
        self._r0, self._col, self._read = r0, min(at, self.max_seq_len), read_len

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # index_put_ into the pool tensors, not a scatter into a row slice: under torch.compile
        # (engine.compile_decode) a slice's in-place scatter becomes a copy of the whole slice
        # every layer and step, while an index_put_ on the tensor stays one in-place store
        kc, vc = self.k[layer], self.v[layer]
        n, r0, col = k.shape[0], self._r0, self._col
        if col is not None:  # each tensor: one narrow and one copy in, one narrow out
            kr, vr = self._rows_of(r0, n)[layer]
            kr.narrow(2, col, 1).copy_(k)
            vr.narrow(2, col, 1).copy_(v)
            return kr.narrow(2, 0, self._read), vr.narrow(2, 0, self._read)
        at = (self._rows, self._heads[kc.shape[1]], self._at)
        kc.index_put_(at, k)
        vc.index_put_(at, v)
        return kc[r0 : r0 + n, :, : self._read], vc[r0 : r0 + n, :, : self._read]

    def _rows_of(self, r0: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._row_views[0] != (r0, n):
            self._row_views = ((r0, n), [(kc[r0 : r0 + n], vc[r0 : r0 + n]) for kc, vc in zip(self.k, self.v, strict=True)])
        return self._row_views[1]

    def move(self, src: int, dst: int, length: int) -> None:
        for t in (*self.k, *self.v):
            t[dst, :, :length] = t[src, :, :length]

    def share(self, src: int, dst: int, count: int, length: int) -> None:
        """Rows dst..dst+count-1 get a copy of row src's first `length` positions (one prefix
        fanned out to the rows that share it: one broadcast copy per cache tensor)."""
        for t in (*self.k, *self.v):
            t[dst : dst + count, :, :length] = t[src : src + 1, :, :length]

    def export(self, row: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [t[row, :, :length].clone() for t in self.k], [t[row, :, :length].clone() for t in self.v]

    def restore(self, row: int, k: list[torch.Tensor], v: list[torch.Tensor], length: int) -> None:
        for dst, src in zip((*self.k, *self.v), (*k, *v), strict=True):
            dst[row, :, :length] = src[:, :length]

    # Every row is preallocated at max_seq_len: admission needs nothing from this pool.
    reserves = False

    def check_fits(self, req: GenerateRequest) -> None:
        pass

    def request_blocks(self, req: GenerateRequest, shared: int = 0) -> int:
        return 0

    def can_take(self, blocks: int) -> bool:
        return True

    def open(self, row: int, req: GenerateRequest) -> None:
        pass

    def release(self, row: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def prepare(self, r0: int, tops: list[int]) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}


@dataclass
class SessionKV:
    ids: list[int]  # tokens whose KV is held
    k: list[torch.Tensor]  # per layer [heads, len, k_dim] (see RowPool)
    v: list[torch.Tensor]
    routed: np.ndarray | None  # [len, L_moe, k] when the turn recorded routing
    # the oldest weight version that wrote any of these positions (a sequence that decoded across
    # an in-place weight update holds KV of two): what `engine.session_kv_reuse` checks
    version: int = 0


class SessionKVStore:
    """LRU map session key -> SessionKV, holding at most `budget_tokens` tokens in total."""

    def __init__(self, budget_tokens: int) -> None:
        self.budget = budget_tokens
        self._items: OrderedDict[str, SessionKV] = OrderedDict()
        self.tokens = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def take(self, key: str) -> SessionKV | None:
        item = self._items.pop(key, None)
        if item is not None:
            self.tokens -= len(item.ids)
        return item

    def put(self, key: str, item: SessionKV) -> None:
        self.take(key)
        if len(item.ids) > self.budget:
            return
        self._items[key] = item
        self.tokens += len(item.ids)
        while self.tokens > self.budget:
            _, old = self._items.popitem(last=False)
            self.tokens -= len(old.ids)
            self.evictions += 1


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
