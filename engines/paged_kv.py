"""Paged KV storage of the torch engine (engine.kv_layout = "paged"): a block pool with block tables.

Per layer one K and one V store [num_blocks + 2, heads, block_tokens, dim]; a running sequence
(an engine row) holds a block table, the blocks of its positions in order. Memory follows the
sequences' lengths: the pool is sized in tokens (engine.kv_pool_tokens), not rows x max_seq_len.

Sharing: rows with a common prompt (engine.share_prompts) point at the same full blocks,
counted by a refcount. A row only ever writes at positions >= its length, so a full block is
never written again and can be shared as is; a partial last block is copied for the sharer
at share time (the sharer writes into it at its very next step, so copy-on-write would copy
it one step later anyway, and the source keeps writing its own).

Admission (`can_take`/`open`): a row reserves the blocks it may need (prompt + max_new_tokens,
capped by max_seq_len, less the full prompt blocks a follower of a group shares) when admitted;
the pool keeps free blocks >= what the open rows may still allocate, so a running batch never
runs out of blocks and nothing is preempted.

Two blocks past `num_blocks` hold no sequence: padded positions (position max_seq_len) write
into the scratch block, and table slots past a row's blocks read the zero block, which nothing
writes; attention masks those keys (pad queries see zeros there, not other pads' writes).

A step's host side (`prepare`: allocate the blocks its writes reach, upload the tables) is
apart from its device side (`bind`: tables -> write and gather indices), so decode CUDA graphs
(`PagedDecodeGraphs`) capture only the latter and replay over any tables.
"""

from __future__ import annotations

import torch

from miles.core.errors import EngineError
from miles.engines.base import GenerateRequest
from miles.engines.cuda_graph import DecodeGraphs
from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM


def blocks_for(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


class PagedPool:
    """Implements `KVCache` and the pool calls of the engine (bind/update/move/share/export/restore)."""

    def __init__(
        self,
        spec: ModelSpec,
        rows: int,
        max_seq_len: int,
        pool_tokens: int,
        block_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.bs = block_tokens
        self.num_blocks = blocks_for(pool_tokens, block_tokens)
        self.scratch, self.zero = self.num_blocks, self.num_blocks + 1  # see the module doc
        self.max_seq_len = max_seq_len
        self.device = device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for layer in range(spec.num_layers):  # dims may differ per layer (qwen3_next's DeltaNet)
            heads, kd, vd = spec.kv_cache_dims_at(layer)
            self.k.append(torch.zeros((self.num_blocks + 2, heads, block_tokens, kd), dtype=dtype, device=device))
            self.v.append(torch.zeros((self.num_blocks + 2, heads, block_tokens, vd), dtype=dtype, device=device))
        self._heads = sorted({t.shape[1] for t in (*self.k, *self.v)})
        self.tables: list[list[int]] = [[] for _ in range(rows)]
        # the tables as a tensor (zero block past a row's blocks), wide enough for every read:
        # kept on the host as the lists change, uploaded once per step (`prepare`)
        self.table_host = torch.full((rows, blocks_for(max_seq_len + 1, block_tokens)), self.zero, dtype=torch.long)
        self.table_dev = self.table_host if device.type == "cpu" else self.table_host.to(device)
        self.caps = [0] * rows  # most blocks each row may hold (its admission reservation)
        self.refs = [0] * self.num_blocks
        self.free = list(range(self.num_blocks - 1, -1, -1))  # a stack: low ids are taken first
        self.peak = 0  # most blocks in use at once so far
        self.in_graph = False  # set by PagedDecodeGraphs around its (captured) forward
        self._read = 0
        self._write: dict[int, torch.Tensor] = {}  # per head count: flat slots this step writes
        self._gather: dict[int, torch.Tensor] = {}  # per head count: flat slots this step reads

    # ---- accounting -----------------------------------------------------------------
    reserves = True  # admission waits until a request's blocks can be reserved

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def stats(self) -> dict[str, int]:
        return {"kv_blocks_used": self.used_blocks, "kv_blocks_peak": self.peak, "kv_blocks": self.num_blocks}

    def outstanding(self) -> int:
        """Blocks the open rows may still allocate (their reservations not yet used)."""
        return sum(max(c - len(t), 0) for c, t in zip(self.caps, self.tables, strict=True))

    def can_take(self, blocks: int) -> bool:
        return len(self.free) - self.outstanding() >= blocks

    def request_blocks(self, req: GenerateRequest, shared: int = 0) -> int:
        """Most blocks a request may allocate: prompt + max_new_tokens, capped by max_seq_len,
        less the full blocks of a `shared`-token prefix it will get by reference."""
        top = min(len(req.input_ids) + req.sampling.max_new_tokens, self.max_seq_len)
        return blocks_for(top, self.bs) - shared // self.bs

    def check_fits(self, req: GenerateRequest) -> None:
        """A request larger than the whole pool could never be admitted: refuse it now."""
        need = self.request_blocks(req)
        if need > self.num_blocks:
            raise EngineError(
                f"request {req.request_id}: prompt {len(req.input_ids)} + max_new_tokens "
                f"{req.sampling.max_new_tokens} (max_seq_len={self.max_seq_len}) needs {need} KV blocks of "
                f"{self.bs} tokens, but the paged pool holds {self.num_blocks} ({self.num_blocks * self.bs} "
                f"tokens, engine.kv_pool_tokens); raise it or shorten the request"
            )

    def open(self, row: int, req: GenerateRequest) -> None:
        """`req` is admitted into row `row`: reserve the blocks it may need."""
        assert not self.tables[row], f"row {row} still holds blocks"
        self.caps[row] = self.request_blocks(req)

    def release(self, row: int) -> None:
        """The row's sequence left: its blocks lose a reference, unreferenced ones are free."""
        for b in self.tables[row]:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)
        self.tables[row] = []
        self.caps[row] = 0
        self.table_host[row] = self.zero

    def reset(self) -> None:
        for row in range(len(self.tables)):
            self.release(row)

    def _alloc(self, row: int) -> int:
        if len(self.tables[row]) >= self.caps[row] or not self.free:
            # admission reserved every block a row may take: reaching this is an engine bug
            raise EngineError(
                f"paged KV: row {row} needs block {len(self.tables[row]) + 1} but reserved {self.caps[row]} "
                f"({len(self.free)} of {self.num_blocks} blocks free)"
            )
        b = self.free.pop()
        self.refs[b] = 1
        self.peak = max(self.peak, self.num_blocks - len(self.free))
        self.tables[row].append(b)
        self.table_host[row, len(self.tables[row]) - 1] = b
        return b

    def bytes_per_token(self) -> int:
        """Cache bytes one token takes over all layers (K and V)."""
        return sum(t[0, :, 0].numel() * t.element_size() for t in (*self.k, *self.v))

    # ---- the forward's view ---------------------------------------------------------
    def prepare(self, r0: int, tops: list[int]) -> None:
        """Host side of a step: rows r0.. get the blocks up to positions `tops` (-1: none), and
        the tables go to the device. A decode graph's step calls it before the replay."""
        for i, top in enumerate(tops):
            while len(self.tables[r0 + i]) * self.bs <= top:
                self._alloc(r0 + i)
        if self.table_dev is not self.table_host:
            self.table_dev.copy_(self.table_host)

    def bind(self, r0: int, pos: torch.Tensor, read_len: int) -> None:
        """The next forward writes rows r0..r0+n-1 at positions pos [n, T] (max_seq_len =
        padding) and reads positions :read_len. Device ops only in a decode graph's forward (the
        step's `prepare` ran before); otherwise it prepares first (one host sync)."""
        n = pos.shape[0]
        real = pos < self.max_seq_len
        if not self.in_graph:
            self.prepare(r0, torch.where(real, pos, -1).amax(dim=1).tolist())
        nb = blocks_for(max(read_len, 1), self.bs)
        table = self.table_dev[r0 : r0 + n, :nb]
        blk = torch.where(real, table.gather(1, pos.clamp(max=nb * self.bs - 1) // self.bs), self.scratch)
        # flat indices per distinct head count into a store viewed as [(num_blocks + 2) * heads *
        # block_tokens, dim]: element (block, head, offset) = (block * heads + head) * block_tokens + offset
        at = torch.arange(read_len, device=self.device)
        rblk = table[:, at // self.bs]  # [n, read_len]: the block of every read position
        self._write, self._gather = {}, {}
        for h in self._heads:
            hh = torch.arange(h, device=self.device)[None, :, None]
            self._write[h] = ((blk[:, None, :] * h + hh) * self.bs + (pos % self.bs)[:, None, :]).reshape(-1)
            self._gather[h] = ((rblk[:, None, :] * h + hh) * self.bs + (at % self.bs)[None, None, :]).reshape(-1)
        self._read = read_len

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._put_get(self.k[layer], k), self._put_get(self.v[layer], v)

    def _put_get(self, store: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        n, h, _, d = x.shape
        if d == 0:  # a DeltaNet layer's empty "v"
            return x.new_zeros(n, h, self._read, 0)
        flat = store.view(-1, d)
        flat.index_copy_(0, self._write[h], x.reshape(-1, d))
        # The gather through the block tables copies every read key once per layer and step:
        # the price of a pool without its own kernel. A paged attention kernel would read the
        # blocks in place instead.
        return flat.index_select(0, self._gather[h]).view(n, h, self._read, d)

    # ---- row operations ------------------------------------------------------------
    def move(self, src: int, dst: int, length: int) -> None:
        """Row src's sequence now sits in row dst (freed by `release`): its table moves, no data."""
        assert not self.tables[dst], f"row {dst} still holds blocks"
        self.tables[dst], self.caps[dst] = self.tables[src], self.caps[src]
        self.tables[src], self.caps[src] = [], 0
        self.table_host[dst] = self.table_host[src]
        self.table_host[src] = self.zero

    def share(self, src: int, dst: int, count: int, length: int) -> None:
        """Rows dst..dst+count-1 get row src's first `length` positions: its full blocks by
        reference, a partial last block as a copy (see the module doc)."""
        full, part = divmod(length, self.bs)
        shared = self.tables[src][:full]
        copies: list[int] = []
        for row in range(dst, dst + count):
            self.release_blocks_only(row)
            for b in shared:
                self.refs[b] += 1
            self.tables[row] = list(shared)
            self.table_host[row, :full] = self.table_host[src, :full]
            if part:
                copies.append(self._alloc(row))
        if copies:
            last, ids = self.tables[src][full], torch.tensor(copies, device=self.device)
            for t in (*self.k, *self.v):
                t[ids] = t[last].clone()  # the source block is a view of t itself

    def release_blocks_only(self, row: int) -> None:
        """Drop a row's blocks but keep its reservation (it is filled anew)."""
        cap = self.caps[row]
        self.release(row)
        self.caps[row] = cap

    def export(self, row: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ids = torch.tensor(self.tables[row][: blocks_for(length, self.bs)], dtype=torch.long, device=self.device)

        def take(t: torch.Tensor) -> torch.Tensor:
            h, d = t.shape[1], t.shape[3]
            return t[ids].transpose(0, 1).reshape(h, len(ids) * self.bs, d)[:, :length].clone()

        return [take(t) for t in self.k], [take(t) for t in self.v]

    def restore(self, row: int, k: list[torch.Tensor], v: list[torch.Tensor], length: int) -> None:
        """Row `row` (just opened) gets `length` positions of a session's exported KV."""
        self.release_blocks_only(row)
        nb = blocks_for(length, self.bs)
        ids = torch.tensor([self._alloc(row) for _ in range(nb)], dtype=torch.long, device=self.device)
        for dst, src in zip((*self.k, *self.v), (*k, *v), strict=True):
            h, d = dst.shape[1], dst.shape[3]
            pad = src.new_zeros(h, nb * self.bs, d)
            pad[:, :length] = src[:, :length]
            dst[ids] = pad.view(h, nb, self.bs, d).transpose(0, 1)


class PagedDecodeGraphs(DecodeGraphs):
    """engines/cuda_graph.py's decode graphs over the paged pool: the step's host side (block
    allocation, table upload) runs in `prepare` before each replay; the captured forward turns
    the device table into its write and gather indices, so a graph serves every table of its
    (batch, key length) bucket. Pad rows of a bucket are empty rows: their table is the zero block."""

    def __init__(self, model: CausalLM, pool: PagedPool, capture: bool = True) -> None:
        super().__init__(model, pool, capture=capture)
        self.rows = len(pool.tables)  # DecodeGraphs reads the row pool's first dim
        self.paged = pool

    def _forward(self, inputs: torch.Tensor, read: int, want_routed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.paged.in_graph = True  # bind: device ops only (no host sync may enter a capture)
        try:
            return super()._forward(inputs, read, want_routed)
        finally:
            self.paged.in_graph = False
