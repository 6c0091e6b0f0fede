"""The SGLang side of `bench/engine.py --sglang`: one stock SGLang server per model, launched and
driven through miles' own `SGLangEngine` (engines/sglang.py), timed on the same requests as the
torch engine (bench/engine_cases.py).

The server loads the bench's random weights from the HF folder miles saved (models/hf_io.py),
runs with CUDA graphs on up to the largest batch, and keeps its radix cache (stock behaviour), but
the cache is flushed before every run, untimed: a round must not reuse the prompts' KV of the
round before, which the torch engine does not keep either. Each response carries the output
tokens' logprobs, as the torch engine computes them too.

SGLang is driven two ways (`SGLangRun(batched=...)`): B concurrent single `/generate` requests
(what a rollout sends through SGLangEngine), and one `/generate` carrying the whole batch (its
native batch API: lists of input_ids, sampling_params and rids), which spares the server B
HTTP requests and lets its scheduler see the batch at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
from engine_cases import Case, check_results, requests_for, sampling_for  # bench/ is on sys.path

from miles.core.errors import EngineError
from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, GenerateResult
from miles.engines.sglang import SGLangEngine
from miles.engines.sglang_wire import ModelFacts, generate_payload, parse_generate

# The flags that started 0.5.17 on the H200 (bench/gpu/README.md) without its JIT-built kernels
# (flashinfer sampling and attention, grammars), minus --disable-cuda-graph.
SGLANG_FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
                "--skip-server-warmup"]
# /get_server_info keys worth keeping with the numbers (what the server actually ran with)
INFO_KEYS = ("version", "attention_backend", "sampling_backend", "cuda_graph_max_bs", "disable_cuda_graph",
             "chunked_prefill_size", "max_prefill_tokens", "max_running_requests", "disable_radix_cache",
             "mem_fraction_static", "context_length", "schedule_policy")


def sglang_config(
    checkpoint: str | Path, cases: Sequence[Case], port: int, stage_dir: str | Path, python: str = "",
    mem_fraction: float = 0.5, start_s: float = 420.0, extra: Sequence[str] = (),
) -> EngineConfig:
    """The server for one model: every case's batch runs at once (max running requests and CUDA
    graphs up to the largest batch) and every case's sequence fits its context."""
    max_batch = max(c.batch for c in cases)
    return EngineConfig(
        type="sglang", dtype="bfloat16", max_batch_size=max_batch,
        max_seq_len=max(c.prompt + c.new for c in cases) + 8, sglang_model_path=str(checkpoint),
        sglang_port=port, sglang_mem_fraction=mem_fraction, sglang_python=python,
        sglang_startup_timeout_s=start_s, sglang_request_timeout_s=600.0,
        sglang_max_restarts=0,  # a crash ends this model's SGLang numbers instead of timing a restart
        sglang_stage_dir=str(stage_dir),
        sglang_extra_args=[*SGLANG_FLAGS, "--cuda-graph-max-bs", str(max_batch), *extra],
    )


def batch_payload(reqs: Sequence[GenerateRequest]) -> dict[str, Any]:
    """One `/generate` body for the whole batch (SGLang's batch form: a list per field), each
    request's fields exactly as SGLangEngine sends them one at a time."""
    if not reqs:
        raise ValueError("a batched /generate needs at least one request")
    one = [generate_payload(r) for r in reqs]
    body: dict[str, Any] = {k: [b[k] for b in one] for k in ("rid", "input_ids", "sampling_params")}
    for k in ("return_logprob", "logprob_start_len", "stream"):
        vals = {json.dumps(b[k]) for b in one}
        if len(vals) != 1:
            raise ValueError(f"batched /generate: requests differ in {k!r}")
        body[k] = one[0][k]
    return body


def parse_batch(body: Any, reqs: Sequence[GenerateRequest], facts: ModelFacts) -> list[GenerateResult]:
    """The batched `/generate` answer (a list, in request order) -> one GenerateResult each."""
    if not isinstance(body, list) or len(body) != len(reqs):
        got = f"a list of {len(body)}" if isinstance(body, list) else type(body).__name__
        raise EngineError(f"batched /generate: expected a list of {len(reqs)} results, got {got}")
    return [parse_generate(b, r, facts) for b, r in zip(body, reqs, strict=True)]


async def post_batch(session: aiohttp.ClientSession, url: str, reqs: Sequence[GenerateRequest],
                     facts: ModelFacts) -> list[GenerateResult]:
    """Send the whole batch as one `/generate` and parse the answer."""
    async with session.post(url.rstrip("/") + "/generate", json=batch_payload(reqs)) as r:
        text = await r.text()
        if r.status != 200:
            raise EngineError(f"batched /generate: HTTP {r.status}: {text[:500]}")
    return parse_batch(json.loads(text), reqs, facts)


class SGLangServerRun:
    """One launched server on its own event loop (the engine's HTTP session lives on it)."""

    def __init__(self, cfg: EngineConfig, pid_file: str | Path | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = SGLangEngine(cfg)
        self.pid_file = Path(pid_file) if pid_file else None
        self.start_s = 0.0
        self.info: dict[str, Any] = {}
        self.closed = False
        self.session: aiohttp.ClientSession | None = None  # the batched runs' own (one request at a time)

    def start(self) -> None:
        t0 = time.perf_counter()
        self.loop.run_until_complete(self._start())
        self.start_s = time.perf_counter() - t0
        try:
            info = self.loop.run_until_complete(self.engine.server_info())
            self.info = {k: info[k] for k in INFO_KEYS if k in info}
        except EngineError as exc:  # the numbers stand without it
            self.info = {"error": str(exc)[:200]}

    async def _start(self) -> None:
        task = asyncio.ensure_future(self.engine.start())
        while not task.done():
            # The server runs in its own session and outlives a killed bench: its pid goes to a file
            # as soon as it exists, so the calling script can end it (bench/gpu/engine_vs_sglang.sh).
            if self.pid_file is not None and self.pid is not None and not self.pid_file.exists():
                self.pid_file.parent.mkdir(parents=True, exist_ok=True)
                self.pid_file.write_text(f"{self.pid}\n")
            await asyncio.wait([task], timeout=0.5)
        task.result()

    @property
    def pid(self) -> int | None:
        server = self.engine.server
        return server.pid if server is not None else None

    def run(self, case: Case, ids: list[list[int]], batched: bool = False) -> SGLangRun:
        return SGLangRun(self, case, ids, batched)

    async def batch_session(self) -> aiohttp.ClientSession:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                total=self.engine.cfg.sglang_request_timeout_s))
        return self.session

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.session is not None:
                self.loop.run_until_complete(self.session.close())
            self.loop.run_until_complete(self.engine.close())  # stops the server's process group
            if self.pid_file is not None:
                self.pid_file.unlink(missing_ok=True)  # nothing left for the script to end
        finally:
            self.loop.close()


class SGLangRun:
    """One case on the server; `__call__` generates the whole batch once: B concurrent requests,
    or with `batched` one batched `/generate`. A failure is reported once and ends SGLang for
    that case and way (`failed`), not the benchmark."""

    def __init__(self, server: SGLangServerRun, case: Case, ids: list[list[int]], batched: bool = False) -> None:
        self.server, self.case, self.ids, self.batched = server, case, ids, batched
        self.sps = sampling_for(case)
        self.failed = ""
        self.cached_tokens = 0  # prompt tokens SGLang's radix cache served in the last run

    def prepare(self) -> None:
        """Untimed, before each run: drop the radix cache of the previous run."""
        if not self.failed:
            self._guard(self.server.loop.run_until_complete, self._flush())

    async def _flush(self) -> None:
        # Let the loop see connections the server closed while it was idle (keep-alive timeout),
        # then flush; a refused flush (server not idle yet) is retried.
        for attempt in range(3):
            await asyncio.sleep(0.05)
            try:
                await self.server.engine.flush_cache()
                return
            except EngineError:
                if attempt == 2:
                    raise
                await asyncio.sleep(0.5)

    async def _all(self) -> None:
        eng = self.server.engine
        reqs = requests_for(self.ids, self.sps)
        if self.batched:
            await eng.start()
            res = await post_batch(await self.server.batch_session(), eng.url, reqs, eng.facts)
        else:
            res = await asyncio.gather(*(eng.generate(r) for r in reqs))
        check_results(self.case, res, "sglang batched" if self.batched else "sglang")
        self.cached_tokens = sum(r.cached_tokens for r in res)

    def __call__(self) -> None:
        if not self.failed:
            self._guard(self.server.loop.run_until_complete, self._all())

    def _guard(self, fn: Any, coro: Any) -> None:
        try:
            fn(coro)
        except Exception as exc:  # noqa: BLE001 - SGLang failing must not lose the torch engine's numbers
            self.failed = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"# sglang failed: {self.failed}", flush=True)
