"""One engine step on the model: batched prefill of newly admitted sequences, batched decode of the rest.

Pure compute (no asyncio); the torch engine runs it in a worker thread while it holds
the step lock, so one step always sees a single weight version.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from miles.core.logging import get_logger
from miles.engines.cuda_graph import DecodeGraphs
from miles.engines.kv_cache import KVPool, RowPool
from miles.engines.paged_kv import PagedDecodeGraphs, PagedPool
from miles.engines.sampling import (
    choose_tokens,
    host_tokens,
    make_generator,
    sample_tokens,
    to_device,
)
from miles.engines.sequence import Sequence
from miles.engines.vl_inputs import choose_unbanned, decode_positions, is_vl, prefill_inputs
from miles.models.decoder import CausalLM
from miles.models.invariant import BatchInvariant, triton_kernels
from miles.models.masks import cached_causal_mask

if TYPE_CHECKING:
    from miles.models.qwen2_5_vl import VLCausalLM

log = get_logger("miles.engine")

# Per sequence: the token chosen this step (None for a flushing sequence) and its logprob.
StepOut = dict[Sequence, tuple[int, float] | None]


@dataclass
class PendingDecode:
    """A decode step launched on the GPU whose tokens the host has not read yet (`Stepper.launch`)."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [n] int64 on the device: the ids sampled, the next step's input
    pos: torch.Tensor  # [n] int64 on the device: the positions this step fed
    host: torch.Tensor  # [2, n] float64 (pinned on CUDA): ids and logprobs, copied without blocking
    ready: torch.cuda.Event | None  # recorded after that copy; None on the CPU (already done)
    routed: bool  # routing was appended for this step's routed requests (dropped with the step)


def _fed_one(seqs: list[Sequence], routed: torch.Tensor | None) -> None:
    """A decode step fed each sequence one token: its KV grew by one, and a routed request keeps
    the step's routing ([n, 1, L, k], row i for seqs[i])."""
    for i, s in enumerate(seqs):
        if s.req.return_routed_experts and routed is not None:
            s.routed.append(routed[i])
        s.kv_len += 1


class Stepper:
    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        device: torch.device,
        batch_invariant: bool = False,
        cuda_graphs: bool = True,
        compile_decode: bool = False,
        overlap: bool = True,
        compile_cpu: bool = False,
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        # true on-policy: logits independent of the batch, equal to the trainer's per-sequence forward
        self.batch_invariant = batch_invariant
        # unseeded requests sample from this one (engines/sampling.py), seeded afresh per engine
        self.rng = make_generator(int.from_bytes(os.urandom(6), "little"), device)
        # the batch-invariant mode is a Python-level op override. Captured, it records the Triton
        # kernels it dispatches to (models/invariant_triton.py, no host syncs); an expert kind
        # without an invariant kernel fails its capture, and decode stays eager (DecodeGraphs.failed).
        # Qwen3-Next's DeltaNet recurrence reduces with torch ops over the graph's padded batch, which
        # the kernels do not cover: it decodes eagerly in this mode.
        # a VL model decodes eagerly: its rotary positions (kv_len + delta) are not the graphs' KV slots
        self.vl = is_vl(model)
        use_graphs = cuda_graphs and device.type == "cuda" and not self.vl and (
            not batch_invariant or (triton_kernels() is not None and model.spec.model_type != "qwen3_next"))
        # compile_decode stays off under batch-invariant mode (its kernels intercept the eager ops);
        # a MoE model's experts run densely under the compile's trace, as in a capture (models/moe.py)
        compiled = compile_decode and not batch_invariant
        self.graphs: DecodeGraphs | None = None
        if use_graphs and isinstance(pool, RowPool):
            self.graphs = DecodeGraphs(model, pool, compiled=compiled)
        elif use_graphs and isinstance(pool, PagedPool):  # not compiled: its bind has a host side
            self.graphs = PagedDecodeGraphs(model, pool)
        elif (compile_cpu and device.type == "cpu" and not self.vl and not batch_invariant
              and isinstance(pool, RowPool)):
            # engine.compile_decode_cpu: the graphs' padded forward, compiled and run without capture.
            # A step of a small model is ~180 eager ops of a few microseconds each; compiled, a few
            # fused C++ kernels. If the compile fails, the padded forward is slower than the eager
            # step, so decode goes eager (`_decode_forward`).
            self.graphs = DecodeGraphs(model, pool, capture=False, compiled=True)
        self._compiled_cpu = self.graphs if self.graphs is not None and device.type == "cpu" else None
        self.overlap = overlap  # engine.overlap_decode

    def _mode(self) -> contextlib.AbstractContextManager[object]:
        """The kernels' mode for a step: batch-invariant (true on-policy) or the default ops."""
        return BatchInvariant() if self.batch_invariant else contextlib.nullcontext()

    def _eager_if_uncompiled(self) -> None:
        """The CPU's compiled decode (engine.compile_decode_cpu) after its compile failed (logged by
        DecodeGraphs): the uncapturable padded forward only costs there, so decode eagerly from now on."""
        g = self._compiled_cpu
        if g is not None and g is self.graphs and g.compile_failed:
            g.failed = True

    def _graphs_failed(self, exc: Exception) -> None:
        """A capture the model cannot take: decode eagerly from now on."""
        assert self.graphs is not None
        self.graphs.failed = True
        log.warning("decode_graphs_disabled", error=f"{type(exc).__name__}: {exc}")

    def warm_up(self, every_batch: bool = False) -> None:
        """Compile and capture the decode forward before serving (`DecodeGraphs.warm_up`); a
        failure leaves decode eager, as a failed capture at a step does."""
        g = self.graphs
        if g is None or g.failed:
            return
        try:
            with self._mode(), torch.inference_mode():
                g.warm_up(every_batch)
            self._eager_if_uncompiled()
        except Exception as exc:  # noqa: BLE001 - decode eagerly instead
            self._graphs_failed(exc)

    def compile_aside(self) -> bool:
        """Worker thread, while the engine serves: the decode compile (`DecodeGraphs.compile_aside`)."""
        g = self.graphs
        if g is None or g.failed:
            return False
        with self._mode(), torch.inference_mode():
            ok = g.compile_aside()
        if not ok and g is self._compiled_cpu:  # CPU: the uncompiled padded forward it serves with only costs
            g.failed = True
        return ok

    def use_compiled(self) -> None:
        """Between steps: swap the compiled decode in (a failure leaves decode eager, as at a step)."""
        g = self.graphs
        if g is None or g.failed:
            return
        try:
            with self._mode(), torch.inference_mode():
                g.use_compiled()
        except Exception as exc:  # noqa: BLE001 - decode eagerly instead
            self._graphs_failed(exc)

    def can_pipeline(self, seqs: list[Sequence]) -> bool:
        """Whether decode steps of `seqs` may be launched ahead (`launch` / `collect`): decode graphs
        in use over the row pool (a paged pool reserves blocks on the host every step), rows from 0."""
        g = self.graphs
        return (self.overlap and g is not None and not g.failed and not self.pool.reserves
                and bool(seqs) and seqs[0].row == 0)

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], prev: PendingDecode | None) -> PendingDecode | None:
        """Launch one decode step of `seqs` (rows 0..n-1) and its sampling, and return without
        waiting for the GPU. Fed from `prev` (the same rows' previous step, not yet read by the
        host) its sampled ids go in on the device, so this step queues behind it while the host
        reads `prev`; the ids of rows that `prev` finishes are computed and then dropped (`collect`).
        None when the decode graphs fail (the engine decodes eagerly from then on, as `step` does)."""
        assert self.graphs is not None
        with self._mode():
            want = any(s.req.return_routed_experts for s in seqs)
            if prev is None:
                ids = to_device([s.tokens[-1] for s in seqs], self.device, torch.long)
                pos = to_device([s.kv_len for s in seqs], self.device, torch.long)
            else:
                ids, pos = prev.tokens, prev.pos + 1
            try:
                logits, routed = self.graphs.run_fed(ids, pos, max(s.kv_len for s in seqs) + 1, want)
                self._eager_if_uncompiled()
            except Exception as exc:  # noqa: BLE001 - decode eagerly instead
                self._graphs_failed(exc)
                return None
            tokens, logps = sample_tokens(logits, [s.req.sampling for s in seqs], [s.generator for s in seqs],
                                          self.rng)
            both = torch.stack((tokens.to(torch.float64), logps.to(torch.float64)))
            ready = None
            if self.device.type == "cuda":
                both = both.to("cpu", non_blocking=True)  # into pinned memory
                ready = torch.cuda.Event()
                ready.record()
        _fed_one(seqs, routed)
        return PendingDecode(seqs, tokens, pos, both, ready, routed is not None)

    def collect(self, p: PendingDecode) -> StepOut:
        """Wait for a launched step and read its tokens. A sequence that finished after the step
        was launched (by `prev`'s tokens) drops its token, and the step's KV and routing no longer
        count for it; one still flushing gets None (its last token is now fed), as in `step`."""
        if p.ready is not None:
            p.ready.synchronize()
        ids, lps = host_tokens(p.host.tolist())
        out: StepOut = {}
        for s, t, lp in zip(p.seqs, ids, lps, strict=True):
            if s.done_pending or (s.finish is not None and not s.flushing):
                s.kv_len -= 1
                if p.routed and s.req.return_routed_experts:
                    s.routed.pop()
                continue
            out[s] = None if s.flushing else (t, lp)
        return out

    @torch.inference_mode()
    def step(self, decode: list[Sequence], prefill: list[Sequence]) -> StepOut:
        out: StepOut = {}
        with self._mode():  # entered here: the step runs in the engine's worker thread
            if prefill:
                out.update(self._prefill(prefill))
            if decode:
                out.update(self._decode(decode))
        return out

    def _prefill(self, seqs: list[Sequence]) -> StepOut:
        """Prefill the leaders (rows first..first+n-1); every follower (same tokens, admitted
        with its leader, rows after the leaders) copies the leader's KV, routing and logits,
        so it holds exactly what its own prefill would have computed."""
        lead = [s for s in seqs if s.share_from is None]
        fed_from = {id(s): s.kv_len for s in lead}  # a leader may start past a copied prefix
        want = any(s.req.return_routed_experts for s in seqs)
        logits, routed = self._prefill_forward(lead, want)
        if len(lead) == len(seqs):
            return self._choose(seqs, logits)
        at = {id(s): i for i, s in enumerate(lead)}
        pick = torch.tensor([at[id(s.share_from or s)] for s in seqs], device=logits.device)
        i = len(lead)
        while i < len(seqs):  # runs of followers of one leader sit in consecutive rows
            src = seqs[i].share_from
            assert src is not None
            j = i
            while j < len(seqs) and seqs[j].share_from is src:
                j += 1
            self.pool.share(src.row, seqs[i].row, j - i, src.kv_len)
            for f in seqs[i:j]:
                f.kv_len = src.kv_len
                f.share_from = None  # shared once, at admission; the row is its own from here
                if f.req.return_routed_experts and routed is not None:
                    # the leader's copied prefix (if any) plus what this prefill fed
                    f.routed_prefix = src.routed_prefix
                    f.routed.append(routed[at[id(src)], : src.kv_len - fed_from[id(src)]])
            i = j
        return self._choose(seqs, logits.index_select(0, pick))

    def _prefill_forward(
        self, seqs: list[Sequence], want: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prefill rows seqs[0].row.. (contiguous) -> (logits [n, V] at each last token,
        routed experts [n, T, L, k] or None)."""
        dev, scratch = self.device, self.pool.max_seq_len
        n = len(seqs)
        new_lens = [len(s.tokens) - s.kv_len for s in seqs]
        tmax = max(new_lens)
        past = torch.tensor([s.kv_len for s in seqs], device=dev)
        ids = torch.zeros(n, tmax, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : new_lens[i]] = torch.tensor(s.tokens[s.kv_len :])
        ids = ids.to(dev)
        steps = torch.arange(tmax, device=dev)
        pos = past[:, None] + steps[None, :]
        real = steps[None, :] < torch.tensor(new_lens, device=dev)[:, None]
        write = torch.where(real, pos, torch.full_like(pos, scratch))
        read = max(len(s.tokens) for s in seqs)
        self.pool.bind(seqs[0].row, write, read)
        extra = prefill_inputs(cast("VLCausalLM", self.model), seqs, ids, new_lens) if self.vl else {}
        res = self.model(
            ids,
            pos,
            attention_mask=cached_causal_mask(past, tmax, read),
            kv_cache=self.pool,
            return_routed_experts=want,
            logits_at=torch.tensor(new_lens, device=dev) - 1,
            **extra,
        )
        for i, s in enumerate(seqs):
            if s.req.return_routed_experts and res.routed_experts is not None:
                s.routed.append(res.routed_experts[i, : new_lens[i]])
            s.kv_len = len(s.tokens)
        assert res.logits is not None
        return res.logits[:, 0], res.routed_experts

    def _decode(self, seqs: list[Sequence]) -> StepOut:
        want = any(s.req.return_routed_experts for s in seqs)
        logits, routed = self._decode_forward(seqs, want)
        _fed_one(seqs, routed)
        live = [i for i, s in enumerate(seqs) if not s.flushing]
        if len(live) == len(seqs):  # the usual case: no gather of the logits
            return self._choose(seqs, logits)
        out: StepOut = {s: None for s in seqs if s.flushing}
        if live:
            out.update(self._choose([seqs[i] for i in live], logits[live]))
        return out

    def _decode_forward(self, seqs: list[Sequence], want: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed every row's last token -> (logits [n, V], routed experts [n, 1, L, k] or None).
        Rows are pool rows 0..n-1 (decode always covers the running rows from the first)."""
        if self.graphs is not None and not self.graphs.failed and seqs[0].row == 0:
            try:
                kv_lens = [s.kv_len for s in seqs]
                if self.pool.reserves:  # blocks and tables, outside the graph
                    self.pool.prepare(0, kv_lens)
                out = self.graphs.run([s.tokens[-1] for s in seqs], kv_lens, want)
                self._eager_if_uncompiled()
                return out
            except Exception as exc:  # noqa: BLE001 - decode eagerly instead
                self._graphs_failed(exc)
        dev = self.device
        lens = torch.tensor([s.kv_len for s in seqs], device=dev)
        ids = torch.tensor([[s.tokens[-1]] for s in seqs], device=dev)
        read = max(s.kv_len for s in seqs) + 1
        # rows of one length (e.g. the samples of one prompt, decoding in lockstep) attend
        # to every cached key: no mask to build, and attention takes its unmasked kernel
        uniform = all(s.kv_len == seqs[0].kv_len for s in seqs)
        if uniform and isinstance(self.pool, RowPool):  # and all write one column: a slice copy
            self.pool.bind_column(seqs[0].row, seqs[0].kv_len, read)
        else:
            self.pool.bind(seqs[0].row, lens[:, None], read)
        extra = {"rope_position_ids": decode_positions(seqs, lens)} if self.vl else {}
        res = self.model(
            ids,
            lens[:, None],
            attention_mask=None if uniform else cached_causal_mask(lens, 1, read),
            kv_cache=self.pool,
            return_routed_experts=want,
            **extra,
        )
        assert res.logits is not None
        return res.logits[:, 0], res.routed_experts

    def _choose(self, seqs: list[Sequence], logits: torch.Tensor) -> StepOut:
        params, gens = [s.req.sampling for s in seqs], [s.generator for s in seqs]
        if self.vl:  # a VL model never samples an image placeholder (engines/vl_inputs.py)
            tokens, logps = choose_unbanned(self.model, logits, params, gens, self.rng)
        else:
            tokens, logps = choose_tokens(logits, params, gens, self.rng)
        return {s: (t, lp) for s, t, lp in zip(seqs, tokens, logps, strict=True)}
