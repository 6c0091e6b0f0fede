"""The embedded torch rollout engine: asyncio front, continuous batching, session prefix reuse.

Every scheduler iteration admits queued requests into free batch rows (prefilled
together), then decodes one token for every running sequence; requests join and
leave between iterations. Iterations run in a worker thread under `_lock`, which
pause/abort/commit also take, so a weight swap always falls between two forward
passes and every forward sees one version.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from miles.core.errors import EngineError
from miles.core.logging import get_logger
from miles.core.schema.engine import EngineConfig
from miles.core.schema.model import ModelConfig
from miles.engines.base import (
    Engine,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    HealthReply,
    PauseMode,
    RequestTotals,
    Staging,
)
from miles.engines.kv_cache import KVPool, RowPool, SessionKV, SessionKVStore, common_prefix
from miles.engines.lora import AdapterMerge
from miles.engines.paged_kv import PagedPool
from miles.engines.prompt_share import PromptShare
from miles.engines.sampling import make_generator
from miles.engines.sequence import Sequence
from miles.engines.stepper import StepOut, Stepper
from miles.engines.validate import validate_request
from miles.engines.vl_inputs import check_request, is_vl
from miles.models.decoder import CausalLM
from miles.models.factory import model_from_config
from miles.models.fp8_layout import fp8_block
from miles.models.fp8_linear import weights_changed
from miles.models.fp8_model import to_fp8_weights
from miles.models.hf_io import checksums, hf_tensor_views
from miles.models.lora import is_adapter_name
from miles.weightsync.stager import WeightStager

log = get_logger("miles.engine")

# One worker-thread hop runs several decode steps (thread handoffs cost ~0.5 ms each, and
# on a loaded CPU host each one may wait a scheduler slice); new requests, pause, abort and
# commit set `_boundary`, which ends a hop after the current step, so these caps are only a
# backstop. The time cap is loose: at 50 ms, a 2-core host at load ~2.5 (steps of ~5-8 ms)
# handed off every ~6-10 steps (105 hops in 10 runs of the CPU bench's b8 case, which needs one).
_MAX_STEPS_PER_HOP = 64
_MAX_HOP_S = 0.5


class TorchEngine(Engine):
    def __init__(
        self,
        model: CausalLM,
        cfg: EngineConfig | None = None,
        version: int = 0,
        *,
        batch_invariant: bool = False,
    ) -> None:
        self.cfg = cfg or EngineConfig()
        self.model = model.eval()
        self.fp8_block = fp8_block(model.spec)
        if self.fp8_block is not None:  # FP8 contract: linear layers hold E4M3 codes + block scales
            to_fp8_weights(model, self.fp8_block, gemm=self.cfg.fp8_gemm)
        self.spec = model.spec
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_seq_len = min(self.cfg.max_seq_len, self.spec.max_position_embeddings)
        if is_vl(model) and self.cfg.kv_layout == "paged":
            raise EngineError("engine.kv_layout='paged' does not serve vision-language models yet; use 'rows'")
        self.pool: KVPool
        if self.cfg.kv_layout == "paged":
            tokens = self.cfg.kv_pool_tokens or self.cfg.max_batch_size * self.max_seq_len
            self.pool = PagedPool(
                self.spec, self.cfg.max_batch_size, self.max_seq_len, tokens, self.cfg.kv_block_tokens,
                self.dtype, self.device,
            )
        else:
            self.pool = RowPool(self.spec, self.cfg.max_batch_size, self.max_seq_len, self.dtype, self.device)
        self.stepper = Stepper(
            model, self.pool, self.device, batch_invariant, self.cfg.cuda_graphs, self.cfg.compile_decode,
            overlap=self.cfg.overlap_decode, compile_cpu=self.cfg.compile_decode_cpu,
        )
        self.sessions = SessionKVStore(self.cfg.kv_budget_tokens)
        self.stale_session_kv = 0  # saved session KV not reused: older weights wrote it (session_kv_reuse)
        self.stager = WeightStager(hf_tensor_views(model), self.fp8_block)
        self.adapters = AdapterMerge(model)  # LoRA runs sync adapters only (engines/lora.py)
        self.version = version
        self._known_sessions: set[str] = set()
        self._queue: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # index == KV row
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._paused = False
        self._boundary = False  # set from the loop: the worker should return after this step
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self._compile_task: asyncio.Task[None] | None = None  # engine.compile_background
        self._last_error = ""
        self._totals = RequestTotals()
        self.share = PromptShare(self.cfg.share_prompts)

    @classmethod
    def from_config(
        cls, cfg: EngineConfig, model_cfg: ModelConfig, vocab_size: int | None = None, version: int = 0
    ) -> TorchEngine:
        model = model_from_config(model_cfg, vocab_size=vocab_size, dtype=cfg.dtype, device=cfg.device)
        return cls(model, cfg, version, batch_invariant=cfg.batch_invariant)

    # ---- requests -----------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        if self._closed:
            raise EngineError("engine is closed")
        validate_request(req, self.spec.vocab_size, self.max_seq_len)
        check_request(req, self.model)
        self.pool.check_fits(req)
        if len(self._queue) >= self.cfg.max_queue:
            raise EngineError(f"engine queue is full ({self.cfg.max_queue} requests waiting)")
        s = req.sampling
        # a seeded request samples with its own generator; unseeded ones share the stepper's
        gen = make_generator(s.seed, self.device) if s.temperature > 0 and s.seed is not None else None
        fut: asyncio.Future[GenerateResult] = asyncio.get_running_loop().create_future()
        seq = Sequence(req=req, future=fut, generator=gen, tokens=list(req.input_ids), n_prompt=len(req.input_ids))
        if req.session_key is not None:
            self._known_sessions.add(req.session_key)
        self._queue.append(seq)
        self._boundary = True
        self._ensure_loop()
        self._wake.set()
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            seq.abort_requested = True  # the caller gave up: free the row at the next step
            self._boundary = True
            self._wake.set()
            raise

    async def abort(self, request_id: str) -> bool:
        self._boundary = True
        async with self._lock:
            for seq in [*self._queue, *self._running]:
                if seq.req.request_id == request_id and not seq.future.done():
                    self._finalize(seq, seq.finish or "abort")
                    return True
        return False

    async def end_session(self, key: str) -> None:
        if key not in self._known_sessions:
            raise EngineError(f"end_session: unknown session {key!r}")
        self._known_sessions.discard(key)
        self.sessions.take(key)

    # ---- pause / weights ----------------------------------------------------------
    async def pause(self, mode: PauseMode = "in_place") -> list[GenerateResult]:
        if mode not in ("abort", "retract", "in_place"):
            raise EngineError(f"pause: unknown mode {mode!r}; valid: abort, retract, in_place")
        self._boundary = True
        async with self._lock:
            self._paused = True
            if mode == "in_place":
                return []
            await self._feed_last_tokens()
            out = []
            for seq in [*self._running, *self._queue]:
                if seq.finish is not None:  # finished, only waiting for its flush step
                    out.append(self._finalize(seq, seq.finish))
                else:
                    out.append(self._finalize(seq, "abort", retracted=mode == "retract"))
            return out

    async def _feed_last_tokens(self) -> None:
        """Before a pause hands out running requests: feed each one's last sampled token, so
        their routing (and saved session KV) covers every token, exactly as for a request that
        finished on its own. The tokens this extra step samples are dropped. Runs under `_lock`,
        between steps, where every running row has all but its last token fed."""
        run = [s for s in self._running if not s.future.done()]
        if not any(s.wants_flush and s.kv_len < len(s.tokens) for s in run):
            return
        if any(s.kv_len != len(s.tokens) - 1 for s in self._running):
            return  # not at a step boundary (cannot happen under the lock); keep results as they are
        try:
            out = await asyncio.to_thread(self.stepper.step, list(self._running), [])
        except Exception as exc:  # noqa: BLE001 - results then lack the last token's routing
            log.error("engine_pause_feed_failed", error=f"{type(exc).__name__}: {exc}")
            return
        for seq in out:
            seq.flushing = False

    async def resume(self) -> None:
        self._paused = False
        self._wake.set()

    async def stage(
        self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> int:
        # a receiver wrote into the slots: bookkeeping only (an empty bucket, e.g. part of a
        # chunked tensor, must not mark the version as a full-weights one: LoRA versions are not)
        if named_tensors and self.stager.in_place(named_tensors):
            return self.stager.stage(version, named_tensors)
        return await asyncio.to_thread(self._stage, version, named_tensors)

    def _stage(
        self, version: int, named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> int:
        """Worker thread: full weights go to the stager, an adapter payload (LoRA) aside."""
        items = named.items() if isinstance(named, Mapping) else named
        full: list[tuple[str, torch.Tensor]] = []
        lora: list[tuple[str, torch.Tensor]] = []
        for name, t in items:
            (lora if is_adapter_name(name) else full).append((name, t))
        if not full and not lora:  # e.g. a bucket holding only part of a chunked tensor
            return 0
        if lora and self.fp8_block is not None:
            raise EngineError(f"stage(version={version}): LoRA adapters cannot be merged into FP8 weights")
        mixed = (self.stager.version == version or bool(full)) if lora else self.adapters.version == version
        if mixed:
            raise EngineError(f"stage(version={version}): a version carries full weights or adapters, not both")
        return self.adapters.stage(version, lora) if lora else self.stager.stage(version, full)

    def staging(self) -> Staging:
        """Its staging slots (`stager`, bound to `model`) take bulk buckets and byte ranges in place."""
        return self

    def mark_staged(self, version: int, names: list[str]) -> int:
        """Full-weight tensors a receiver wrote into their slots (a flat export's range)."""
        if self.adapters.version == version:
            raise EngineError(f"stage(version={version}): a version carries full weights or adapters, not both")
        return self.stager.mark_staged(version, names)

    async def commit(self, version: int) -> None:
        with_adapters = self.adapters.version == version
        if with_adapters:  # merge onto the base and stage the whole model locally
            merged = await asyncio.to_thread(self.adapters.merged_state, version)
            await asyncio.to_thread(self.stager.stage, version, merged)
        self.stager.check_complete(version)
        self._boundary = True
        async with self._lock:
            if self.stager.instant_apply:
                self.stager.apply()
            else:
                await asyncio.to_thread(self.stager.apply)
            weights_changed()  # tensors cached from the weights (CPU: FP8's Ŵ, q/k norms) are stale now
            self.version = version
            if with_adapters:
                self.adapters.committed_version()
        log.info("engine_weights_committed", version=version, adapters=with_adapters)

    async def abort_version(self, version: int) -> None:
        if self.stager.version == version:
            self.stager.drop()
        if self.adapters.version == version:
            self.adapters.drop()

    # ---- introspection ------------------------------------------------------------
    def health(self) -> HealthReply:
        alive = self._task is None or not self._task.done()
        return {
            "ok": alive and not self._closed,
            "version": self.version,
            "paused": self._paused,
            "running": len(self._running),
            "queued": len(self._queue),
            "device": str(self.device),
            "last_error": self._last_error,
        }

    def stats(self) -> dict[str, Any]:
        return {
            **self._totals.snapshot(),
            "running": len(self._running),
            "queued": len(self._queue),
            "cached_tokens": self.sessions.tokens,
            "shared_prompt_tokens": self.share.tokens,
            "cached_sessions": len(self.sessions),
            "evictions": self.sessions.evictions,
            "stale_session_kv": self.stale_session_kv,
            "version": self.version,
            **self.pool.stats(),
        }

    def checksums(self) -> dict[str, str]:
        """Every live weight, plus (LoRA runs) the adapters merged into them, as received."""
        return {**checksums(self.model), **self.adapters.checksums()}

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in hf_tensor_views(self.model).items()}

    async def warm_up(self) -> None:
        """Capture the decode graphs now, compiled (engine.compile_decode: 50-110 s on an H200 for
        the bench models) or, with engine.compile_background, uncompiled at once while the
        compile runs in a worker thread and is swapped in when ready (`compile_done`)."""
        g = self.stepper.graphs
        if g is None:
            return
        t0 = time.monotonic()
        background = g.compiled and self.cfg.compile_background
        if background:
            g.compiled = False  # serve with uncompiled graphs until the compile is ready
        async with self._lock:  # background: every batch bucket, uncompiled (seconds), as no capture may overlap it
            await asyncio.to_thread(self.stepper.warm_up, background)
        log.info("engine_warmed_up", seconds=round(time.monotonic() - t0, 1), compiled=g.compiled,
                 graphs_failed=g.failed, compiling_in_background=background and not g.failed)
        if background and not g.failed:
            log.info("decode_compile_started", note="serving with uncompiled decode graphs until it is ready")
            self._compile_task = asyncio.get_running_loop().create_task(self._compile_in_background(),
                                                                        name="decode-compile")

    async def _compile_in_background(self) -> None:
        t0 = time.monotonic()
        ok = await asyncio.to_thread(self.stepper.compile_aside)
        if not ok or self._closed:
            log.warning("decode_compile_skipped", seconds=round(time.monotonic() - t0, 1),
                        reason="engine closed" if self._closed else "the compile failed: serving uncompiled graphs")
            return
        t1 = time.monotonic()
        async with self._lock:  # between hops: no decode step is in flight
            if self._closed:
                return
            await asyncio.to_thread(self.stepper.use_compiled)
        g = self.stepper.graphs
        log.info("decode_compile_ready", compile_s=round(t1 - t0, 1), swap_s=round(time.monotonic() - t1, 1),
                 compiled=g is not None and g.compiled)

    async def compile_done(self) -> bool:
        """Wait for a background decode compile (if one runs); whether decode is compiled now."""
        if self._compile_task is not None:
            await asyncio.shield(self._compile_task)
        g = self.stepper.graphs
        return g is not None and g.compiled and not g.failed

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for seq in [*self._running, *self._queue]:
            if not seq.future.done():
                seq.future.set_exception(EngineError("engine closed"))
        self._running, self._queue = [], deque()
        self.share.clear()
        self.pool.reset()

    # ---- scheduler ----------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="torch-engine")

    async def _loop(self) -> None:
        while not self._closed:
            if self._paused or not (self._queue or self._running):
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._lock:
                if self._paused:
                    continue
                self._reap_aborts()
                decode = list(self._running)
                prefill = self._admit()
                if not decode and not prefill:
                    continue
                self._boundary = False
                try:
                    await asyncio.to_thread(self._run_steps, decode, prefill)
                except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the engine
                    self._fail_running(exc)
                    continue
                for seq in list(self._running):
                    if seq.done_pending:
                        self._finalize(seq, seq.finish or "abort")
            await asyncio.sleep(0)

    def _run_steps(self, decode: list[Sequence], prefill: list[Sequence]) -> None:
        """Worker thread: step until a sequence finishes or the loop needs a boundary
        (new request, pause, abort, commit), at most `_MAX_STEPS_PER_HOP` steps."""
        t_end = time.monotonic() + _MAX_HOP_S
        self._apply(self.stepper.step(decode, prefill))
        decode = decode + prefill
        if self._hop_over(decode, t_end):
            return
        if self.stepper.can_pipeline(decode):
            self._run_pipelined(decode, t_end)
            return
        for _ in range(_MAX_STEPS_PER_HOP - 1):
            self._apply(self.stepper.step(decode, []))
            if self._hop_over(decode, t_end):
                return

    def _run_pipelined(self, decode: list[Sequence], t_end: float) -> None:
        """The decode steps of a hop with one step always queued ahead (engine.overlap_decode):
        step k+1 is launched from step k's ids on the GPU before the host reads step k, so the
        host's per-token work (reading, stop checks, the next launch) runs while the GPU computes
        instead of between its steps. The hop ends as `_run_steps` does, after reading the step
        in flight, whose ids count only for sequences that had not finished."""
        pending = self.stepper.launch(decode, None)
        for _ in range(_MAX_STEPS_PER_HOP - 2):
            if pending is None:  # the graphs failed: the next hop decodes eagerly
                return
            ahead = self.stepper.launch(decode, pending)
            self._apply(self.stepper.collect(pending))
            pending = ahead
            if self._hop_over(decode, t_end):
                break
        if pending is not None:
            self._apply(self.stepper.collect(pending))

    def _hop_over(self, decode: list[Sequence], t_end: float) -> bool:
        return self._boundary or any(s.done_pending for s in decode) or time.monotonic() > t_end

    def _reap_aborts(self) -> None:
        for seq in [*self._running, *self._queue]:
            if seq.abort_requested:
                self._finalize(seq, "abort")

    def _admit(self) -> list[Sequence]:
        taken: list[Sequence] = []
        reserved = 0  # paged KV: blocks the requests taken so far reserve
        leaders: set[tuple[int, ...]] = set()  # paged KV: prompts a request taken so far prefills
        while self._queue and len(self._running) + len(taken) < self.cfg.max_batch_size:
            if self.pool.reserves:  # in order: wait until the head's blocks are free
                need = self._blocks_needed(self._queue[0], leaders)
                if not self.pool.can_take(reserved + need):
                    break
                reserved += need
            taken.append(self._queue.popleft())
        new = self.share.order(taken, self._has_session)
        # leaders whose followers want routing: their copied prefix must carry it
        routed_for = {id(s.share_from) for s in new if s.share_from is not None and s.req.return_routed_experts}
        for seq in new:
            seq.row = len(self._running)
            self._running.append(seq)
            self.pool.open(seq.row, seq.req)
            seq.kv_version = self.version  # what it computes from here on (a restore may lower it)
            if seq.share_from is None:
                self._restore_session(seq)
                if seq.kv_len == 0:
                    self._copy_running_prompt(seq, seq.req.return_routed_experts or id(seq) in routed_for)
            self.share.register(seq, self.version)
            self._totals.prompt += seq.n_prompt
            self._totals.cached += seq.cached
            self._totals.requests += 1
        return new

    def _blocks_needed(self, seq: Sequence, leaders: set[tuple[int, ...]]) -> int:
        """KV blocks `seq` reserves if admitted now; a follower of a prompt already taken this
        round shares its full prompt blocks (the rule PromptShare.order applies), and `leaders`
        gains seq's prompt when it may lead."""
        key = tuple(seq.tokens)
        shares = self.share.enabled and not self._has_session(seq)
        need = self.pool.request_blocks(seq.req, shared=len(key) if shares and key in leaders else 0)
        if shares:
            leaders.add(key)
        return need

    def _has_session(self, seq: Sequence) -> bool:
        key = seq.req.session_key
        return key is not None and key in self.sessions

    def _copy_running_prompt(self, seq: Sequence, routed: bool) -> None:
        """A running row holds seq's prompt (a group's earlier sample: all but its last token
        is copied) or begins like it (whole common blocks are); seq's prefill feeds the rest
        (engines/prompt_share.py). `routed`: seq or one of its followers reports routing, so
        the source must have it and seq keeps the prefix's."""
        found = self.share.source(seq, self.version, routed)
        if found is None:
            return
        src, n = found
        self.pool.share(src.row, seq.row, 1, n)
        seq.kv_len = n
        if routed:
            experts = src.routed_array(self.spec)
            assert experts is not None
            seq.routed_prefix = experts[:n]
        self.share.tokens += n

    def _restore_session(self, seq: Sequence) -> None:
        key = seq.req.session_key
        item = self.sessions.take(key) if key is not None else None
        if item is None:
            return
        if item.version != self.version and self.cfg.session_kv_reuse == "same_version":
            self.stale_session_kv += 1  # written (in part) by older weights: the turn recomputes it
            return
        n = min(common_prefix(item.ids, seq.tokens), len(seq.tokens) - 1)
        if seq.req.return_routed_experts and item.routed is None:
            n = 0  # the cached turn has no routing record; recompute to return it
        if n <= 0:
            return
        self.pool.restore(seq.row, item.k, item.v, n)
        seq.cached = seq.kv_len = n
        seq.kv_version = min(seq.kv_version, item.version)
        if item.routed is not None:
            seq.routed_prefix = item.routed[:n]

    def _apply(self, out: StepOut) -> None:
        """Record this step's tokens (worker thread; touches only sequence state)."""
        for seq, chosen in out.items():
            if seq.future.done():
                continue
            if chosen is None:  # flush step done
                seq.done_pending = True
                continue
            tok, lp = chosen
            seq.tokens.append(tok)
            seq.output.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(self.version)
            self._totals.generated += 1
            s = seq.req.sampling
            reason: FinishReason | None = None
            if tok in s.stop_token_ids:
                reason = "stop"
            elif len(seq.output) >= s.max_new_tokens or len(seq.tokens) >= self.max_seq_len:
                reason = "length"
            if reason is None:
                continue
            seq.finish = reason
            if seq.wants_flush:
                seq.flushing = True
            else:
                seq.done_pending = True

    def _finalize(self, seq: Sequence, reason: FinishReason, retracted: bool = False) -> GenerateResult:
        result = seq.result(reason, retracted, self.spec)
        if seq in self._queue:
            self._queue.remove(seq)
        elif seq.row >= 0 and seq.row < len(self._running) and self._running[seq.row] is seq:
            self._save_session(seq)
            self._release_row(seq)
        if not seq.future.done():
            seq.future.set_result(result)
        return result

    def _save_session(self, seq: Sequence) -> None:
        key = seq.req.session_key
        if key is None or key not in self._known_sessions or seq.kv_len == 0:
            return
        k, v = self.pool.export(seq.row, seq.kv_len)
        routed = seq.routed_array(self.spec)
        self.sessions.put(key, SessionKV(ids=seq.tokens[: seq.kv_len], k=k, v=v, routed=routed,
                                         version=seq.kv_version))

    def _release_row(self, seq: Sequence) -> None:
        self.share.release(seq)
        row, last = seq.row, self._running[-1]
        self.pool.release(row)
        if last is not seq:  # keep rows compact: the last sequence moves into the hole
            self.pool.move(last.row, row, last.kv_len)
            self._running[row] = last
            last.row = row
        self._running.pop()
        seq.row = -1

    def _fail_running(self, exc: Exception) -> None:
        self._last_error = f"{type(exc).__name__}: {exc}"
        log.error("engine_step_failed", error=self._last_error)
        for seq in self._running:
            if not seq.future.done():
                seq.future.set_exception(EngineError(f"engine step failed: {self._last_error}"))
            seq.row = -1
        self._running = []
        self.share.clear()
        self.pool.reset()
