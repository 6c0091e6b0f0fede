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
from miles.engines.kv_cache import KVPool, RowPool
from miles.engines.kv_reuse import KVReuse
from miles.engines.paged_kv import PagedPool
from miles.engines.prompt_share import PromptShare
from miles.engines.sampling import make_generator
from miles.engines.sequence import Sequence
from miles.engines.stepper import StepOut, Stepper
from miles.engines.torch_compile import DecodeWarmUp
from miles.engines.torch_weights import TorchWeights
from miles.engines.validate import validate_request
from miles.engines.vl_inputs import check_request, is_vl
from miles.models.decoder import CausalLM
from miles.models.factory import model_from_config
from miles.models.hf_io import hf_tensor_views

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
        self.weights = TorchWeights(model, self.cfg)  # staging + commit (FP8 codes, LoRA adapters)
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
        self._last_error = ""
        self._totals = RequestTotals()
        self.share = PromptShare(self.cfg.share_prompts)
        self.kv_reuse = KVReuse(self.cfg, self.spec, self.pool, self.share)  # session KV, running-prompt copies
        self.decode_warm_up = DecodeWarmUp(self.stepper, self._lock, self.cfg.compile_background,
                                           lambda: self._closed)

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
        self.kv_reuse.sessions.take(key)

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
        return await self.weights.stage(version, named_tensors)

    def staging(self) -> Staging:
        """Its weights' staging slots (`weights.stager`, bound to `model`) take bulk buckets and
        byte ranges in place."""
        return self.weights

    async def commit(self, version: int) -> None:
        with_adapters = await self.weights.ready(version)
        self._boundary = True
        async with self._lock:
            await self.weights.apply(with_adapters)
            self.version = version
        log.info("engine_weights_committed", version=version, adapters=with_adapters)

    async def abort_version(self, version: int) -> None:
        self.weights.abort_version(version)

    # ---- introspection ------------------------------------------------------------
    def health(self) -> HealthReply:
        alive = self._task is None or not self._task.done()
        return HealthReply(version=self.version, ok=alive and not self._closed, paused=self._paused,
                           running=len(self._running), queued=len(self._queue), device=str(self.device),
                           last_error=self._last_error)

    def stats(self) -> dict[str, Any]:
        return {
            **self._totals.snapshot(),
            "running": len(self._running),
            "queued": len(self._queue),
            "cached_tokens": self.kv_reuse.sessions.tokens,
            "shared_prompt_tokens": self.share.tokens,
            "cached_sessions": len(self.kv_reuse.sessions),
            "evictions": self.kv_reuse.sessions.evictions,
            "stale_session_kv": self.kv_reuse.stale,
            "version": self.version,
            **self.pool.stats(),
        }

    def checksums(self) -> dict[str, str]:
        """Every live weight, plus (LoRA runs) the adapters merged into them, as received."""
        return self.weights.checksums()

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in hf_tensor_views(self.model).items()}

    async def warm_up(self) -> None:
        """Capture the decode graphs now (engines/torch_compile.py: compiled, or uncompiled at once
        with engine.compile_background while the compile runs aside until `compile_done`)."""
        await self.decode_warm_up.warm_up()

    async def compile_done(self) -> bool:
        """Wait for a background decode compile (if one runs); whether decode is compiled now."""
        return await self.decode_warm_up.done()

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
                need = self.kv_reuse.blocks_needed(self._queue[0], leaders)
                if not self.pool.can_take(reserved + need):
                    break
                reserved += need
            taken.append(self._queue.popleft())
        new = self.share.order(taken, self.kv_reuse.has_session)
        # leaders whose followers want routing: their copied prefix must carry it
        routed_for = {id(s.share_from) for s in new if s.share_from is not None and s.req.return_routed_experts}
        for seq in new:
            seq.row = len(self._running)
            self._running.append(seq)
            self.pool.open(seq.row, seq.req)
            seq.kv_version = self.version  # what it computes from here on (a restore may lower it)
            self.kv_reuse.fill(seq, self.version, seq.req.return_routed_experts or id(seq) in routed_for)
            self.share.register(seq, self.version)
            self._totals.prompt += seq.n_prompt
            self._totals.cached += seq.cached
            self._totals.requests += 1
        return new

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
            self.kv_reuse.save(seq, self._known_sessions)
            self._release_row(seq)
        if not seq.future.done():
            seq.future.set_result(result)
        return result

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
