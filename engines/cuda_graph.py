"""CUDA-graph replay of the engine's decode forward, one graph per (batch, key-length) bucket.

A decode step of a small model is a few hundred tiny kernels; launched one by one from
Python, the GPU mostly waits for the host. Here the whole forward (mask, rotary, KV
scatter, attention, MLP / MoE, LM head) is captured once per bucket and replayed with one
launch. Shapes are made static by padding:

- the batch to the next bucket (powers of two from 2 up to the pool's row count): pad rows get
  position `max_seq_len`, the pool's scratch column, so their KV writes land where no
  sequence reads and their outputs are ignored;
- the key length to the next power of two >= 256 (at most the pool's width), with the
  causal mask hiding keys past each row's length.

Decode rows are always pool rows 0..n-1 (the engine keeps rows compact), so a graph
writes the same KV tensors every replay; inputs live in static device tensors that are
refilled (one host-to-device copy) before each replay. A weight commit swaps the
parameters between two persistent storages (weightsync/stager.py), so graphs are kept per
weight storage: after the first two commits both sets have theirs and a commit costs no
copy and no capture. Graphs share one memory pool and never run concurrently (the engine
steps under its lock); the swap to compiled graphs starts a new pool (`use_compiled`).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from miles.core.logging import get_logger
from miles.engines.kv_cache import KVPool, RowPool
from miles.engines.sampling import to_device
from miles.models.decoder import CausalLM
from miles.models.masks import cached_causal_mask

log = get_logger("miles.engine.graphs")

_MIN_READ = 256


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [2, B] int64: last token ids, fed positions (= cached lengths)
    logits: torch.Tensor  # [B, V]
    routed: torch.Tensor | None  # [B, 1, L_moe, k]


@functools.cache
def _compiled_forward(cls: type[DecodeGraphs]) -> Callable[..., Any]:
    """`cls._forward` under torch.compile, made once per process: one code object for every
    engine, so engines of one model share a compile (dynamic shapes cover their buckets)."""
    return torch.compile(cls._forward, dynamic=True)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class DecodeGraphs:
    def __init__(self, model: CausalLM, pool: KVPool, capture: bool = True, compiled: bool = False) -> None:
        self.model = model
        self.pool = pool
        self.rows = pool.k[0].shape[0]
        self.scratch = pool.max_seq_len
        # capture=False runs the same padded, bucketed forward eagerly (CPU tests of the layout)
        self.capture = capture
        # compiled (engine.compile_decode): the captured forward is torch.compile'd first, so one
        # graph replays fused kernels (norms, rotary, activations) instead of hundreds of small
        # ones. Dynamic shapes: one compile serves every (batch, key length) bucket; it runs in
        # a bucket's warm-up, outside the capture. A compile or capture that fails falls back to
        # the uncompiled forward (`_graph`), not to eager decode.
        self.compiled = compiled
        self.moe = model.spec.is_moe
        self._graphs: dict[tuple[int, int, bool, tuple[int, int]], _Graph] = {}
        self._mempool: torch.cuda._POOL_HANDLE | None = None
        self.failed = False  # a capture failed: the engine falls back to eager decode for good
        self.compile_failed = False  # the compile failed (`_uncompile`): the forward runs uncompiled
        self.aside = False  # a compile runs in another thread (`compile_aside`): capture nothing new

    def buckets(self, n: int, read: int) -> tuple[int, int]:
        # at least 2 rows: a compiled forward specializes a size of 1, and would compile again for it
        b = min(max(_pow2_at_least(n), 2), self.rows)
        r = min(max(_pow2_at_least(read), _MIN_READ), self.scratch + 1)
        return b, r

    def run(
        self, ids: list[int], lens: list[int], want_routed: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode rows 0..n-1 (last token ids, cached lengths) -> (logits [n, V], routed [n, 1, L, k]).

        The logits are the graph's static output, valid until the next replay; routed is a copy."""
        dev = self.pool.k[0].device
        return self.run_fed(to_device(ids, dev, torch.long), to_device(lens, dev, torch.long), max(lens) + 1,
                            want_routed)

    def run_fed(
        self, ids: torch.Tensor, pos: torch.Tensor, read: int, want_routed: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`run` with the inputs already on the device (ids [n], positions [n] int64; `read` > every
        position): a pipelined step feeds the ids the previous step sampled without the host
        reading them first, and nothing here waits for the GPU."""
        n = ids.shape[0]
        b, r = self.buckets(n, read)
        # while a compile runs aside (another thread), a bucket not captured yet runs eagerly: no
        # capture may overlap that thread's kernel launches and synchronizations
        if not self.capture or (self.aside and not self._has(b, r, self._routed(want_routed))):
            pad = torch.tensor([[0], [self.scratch]], dtype=torch.long, device=ids.device).expand(2, b - n)
            logits, routed = self._fwd_call(torch.cat((torch.stack((ids, pos)), pad), dim=1), r,
                                            self._routed(want_routed))
        else:
            g = self._graph(b, r, self._routed(want_routed))
            g.inputs[0, :n].copy_(ids)
            g.inputs[1, :n].copy_(pos)
            if n < b:  # pad rows: token 0 at the scratch column (a bucket's inputs may hold another batch's rows)
                g.inputs[0, n:].zero_()
                g.inputs[1, n:].fill_(self.scratch)
            g.graph.replay()
            logits, routed = g.logits, None if g.routed is None or not want_routed else g.routed[:n].clone()
        return logits[:n], None if routed is None or not want_routed else routed[:n]

    def _routed(self, want: bool) -> bool:
        """Whether the forward records routing: always for a MoE model (a few ids per token), so
        that one compile and one graph per bucket serve requests with and without R3."""
        return want or self.moe

    def warm_up(self, every_batch: bool = False) -> None:
        """Compile (engine.compile_decode) and capture the smallest bucket now, before requests
        arrive: the compile takes 50-110 s on an H200 for the bench models, which at the first decode step would count
        against the first requests' deadlines. Later buckets reuse the compile. `every_batch`:
        capture every batch bucket at the shortest key length (what a run's first steps use),
        for uncompiled graphs that serve while a compile runs aside and may capture nothing new."""
        b, r = self.buckets(2, 1)
        if self.capture:
            sizes = sorted({self.buckets(n, 1)[0] for n in range(2, self.rows + 1)}) if every_batch else [b]
            for size in sizes:
                self._graph(size, r, self.moe)
            return
        dev = self.pool.k[0].device
        inputs = torch.tensor([[0] * b, [self.scratch] * b], dtype=torch.long, device=dev)
        self._fwd_call(inputs, r, self.moe)

    def compile_aside(self) -> bool:
        """Make the decode forward's compile (engine.compile_decode) without touching what this
        object serves: the compiled forward runs once over a 2-row pool of its own (its KV
        writes land there), so the engine can keep decoding with its uncompiled graphs while
        this runs in another thread (engine.compile_background). The compile is per process
        (`_compiled_forward`) and dynamic in the pool's rows, so `use_compiled` then reuses
        it. Whether it compiled (False: it failed and was logged; stay uncompiled)."""
        p = self.pool
        dev = p.k[0].device
        with torch.inference_mode(False):  # tensors like the live pool's (made outside it): the same guards
            small = RowPool(self.model.spec, 2, p.max_seq_len, p.k[0].dtype, dev)
        aside = DecodeGraphs(self.model, small, capture=False, compiled=True)
        self.aside = True
        try:
            if dev.type != "cuda":
                aside.warm_up()
                return aside.compiled
            stream = torch.cuda.Stream(dev)  # a non-blocking stream: no implicit sync with the engine's
            with torch.cuda.stream(stream):
                aside.warm_up()
            stream.synchronize()
            return aside.compiled
        finally:
            self.aside = False

    def use_compiled(self) -> None:
        """Serve compiled from now on (after `compile_aside`): the uncompiled graphs are dropped
        and each bucket is captured again, from the compiled forward, at its next use (the
        smallest one now). Call between steps: no replay may be in flight."""
        self.compiled = True
        # A fresh memory pool for the new graphs. The allocator keeps a pool's entry while any of
        # its blocks is alive (a caller's view of an old graph's logits, a launched step's
        # output), and a capture into an entry whose graphs are all destroyed fails its
        # `use_count > 0` INTERNAL ASSERT: the H200's background-compile swap (issue 49).
        # The old pool's memory is released once its last tensor is gone (the next capture's
        # empty_cache, or the allocator under memory pressure).
        self._mempool = None
        self._graphs.clear()
        self.warm_up()

    def _has(self, b: int, read: int, want_routed: bool) -> bool:
        return (b, read, want_routed, self._weights()) in self._graphs

    def _graph(self, b: int, read: int, want_routed: bool) -> _Graph:
        key = (b, read, want_routed, self._weights())
        g = self._graphs.get(key)
        if g is None:
            try:
                g = self._capture(b, read, want_routed)
            except Exception as exc:  # noqa: BLE001 - the uncompiled forward is captured instead
                if not self.compiled:
                    raise
                self._uncompile(exc)
                g = self._capture(b, read, want_routed)
            self._graphs[key] = g
        return g

    def _weights(self) -> tuple[int, int]:
        """Which weight storage the parameters live in now (a graph holds its pointers).

        The storage's address and size: once the stager has packed the parameters into its
        two flat buffers, these are the only two values, and a storage of the pre-packing
        layout (one parameter's size) can never be taken for one of them.
        """
        st = next(self.model.parameters()).untyped_storage()
        return st.data_ptr(), st.nbytes()

    def _fwd_call(self, inputs: torch.Tensor, read: int, want_routed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.compiled:
            # loaded with torch.compile anyway
            from torch.fx.experimental import _config as fx_config

            try:
                # No duck sizing: the first batch bucket often equals the pool's row count, and a
                # compile that assumed them equal would compile again for every smaller bucket.
                with fx_config.patch(use_duck_shape=False):  # type: ignore[attr-defined]  # added at import (install_config_module)
                    out: tuple[torch.Tensor, torch.Tensor | None] = _compiled_forward(
                        type(self))(  # type: ignore[arg-type]  # a class is hashable; mypy reads its instances' __hash__
                        self, inputs, read, want_routed)
                return out
            except Exception as exc:  # noqa: BLE001 - the compile failed: run the forward uncompiled
                if inputs.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise  # `_graph` captures the uncompiled forward instead
                self._uncompile(exc)
        return self._forward(inputs, read, want_routed)

    def _uncompile(self, exc: Exception) -> None:
        log.warning("decode_compile_disabled", error=f"{type(exc).__name__}: {str(exc)[:500]}")
        self.compiled = False
        self.compile_failed = True

    def _forward(
        self, inputs: torch.Tensor, read: int, want_routed: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids, lens = inputs[0][:, None], inputs[1]
        pos = lens[:, None]
        self.pool.bind(0, pos, read)
        res = self.model(
            ids,
            pos,
            attention_mask=cached_causal_mask(lens, 1, read),
            kv_cache=self.pool,
            return_routed_experts=want_routed,
        )
        assert res.logits is not None
        return res.logits[:, 0], res.routed_experts

    def _capture(self, b: int, read: int, want_routed: bool) -> _Graph:
        dev = self.pool.k[0].device
        inputs = torch.zeros(2, b, dtype=torch.long, device=dev)
        inputs[1] = self.scratch  # every row writes the scratch column while warming up
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph: lazy inits, autotuning, workspaces
                self._fwd_call(inputs, read, want_routed)
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # No garbage collection while capturing: a collection run by this thread could free an
        # unreachable CUDA graph (another engine's, a dropped bucket's), and destroying a graph
        # is not permitted on a capturing thread; it invalidates the capture.
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            # The outer stream context restores this thread's stream however the capture ends:
            # torch.cuda.graph enters its stream before `capture_begin` and leaves it only in a
            # clean `__exit__`, so a capture_begin (or capture_end) that raises would leave the
            # thread on the capture stream, and its later steps (a worker thread runs them)
            # unordered with the engine's stream.
            with torch.cuda.stream(side), torch.cuda.graph(graph, pool=self._mempool, stream=side,
                                                           capture_error_mode="thread_local"):
                logits, routed = self._fwd_call(inputs, read, want_routed)
        finally:
            if gc_was_on:
                gc.enable()
        log.info("decode_graph_captured", batch=b, read=read, routed=want_routed, graphs=len(self._graphs) + 1)
        return _Graph(graph, inputs, logits, routed)
