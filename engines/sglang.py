"""`SGLangEngine`: the engine contract (engines/base.py) served by a stock SGLang server over HTTP.

Tested against SGLang 0.5.17 (sglang/srt/entrypoints/http_server.py). Endpoints used:
  POST /generate                  input_ids + sampling_params + rid + return_logprob [+ return_routed_experts]
  POST /pause_generation          {"mode": "abort"}; POST /continue_generation {}
  POST /abort_request             {"rid": ...}
  POST /flush_cache
  POST /update_weights_from_disk  {"model_path", "weight_version", "flush_cache": true}
  POST /get_weights_by_name       {"name", "truncate_size"} (checksums of unfused tensors)
  GET  /health, GET /get_model_info (model_path, weight_version)
Request/response fields: engines/sglang_wire.py. Launcher: engines/sglang_server.py.

Weight updates (engines/sglang_update.py, engine.sglang_weight_update): every bucket of a
version is staged on this side; commit checks that every tensor of the checkpoint is there and
hands the whole version to the server, in memory (/update_weights_from_tensor: CUDA IPC
handles where the engine stages on the server's GPU) or through a safetensors folder
(/update_weights_from_disk), with the new weight_version. commit runs while generation is
paused, so no request sees a mix of versions. Not offered:
  - /update_weights_from_distributed loads every bucket into the live model as it arrives
    (no atomic staging of a whole version), and NCCL refuses two ranks on one GPU, the
    colocated case the tensor path covers;
  - pause(mode="in_place") exists in SGLang, but the server reports one weight_version per
    response, so tokens of a request held across a commit could not be given their versions
    (the launch check refuses sync.pause_mode in_place / none with engine.type = sglang).

Start and failures: `warm_up` (called by the engine role before it registers) launches the
server, waits for /health and runs one request, so the server's 60-150 s start never counts
against a request's deadline. A server that fails at start raises EngineStartError carrying
its own error lines and is not restarted; a server that had served and crashed is restarted
by a watchdog (engine.sglang_max_restarts), brought back to the committed version, and until
then health() says not ok and requests in flight at the crash fail with EngineDown.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import torch
from safetensors import safe_open

from miles.core.clock import Deadline
from miles.core.errors import EngineDown, EngineError, EngineStartError
from miles.core.logging import get_logger
from miles.core.schema.engine import EngineConfig
from miles.core.schema.model import ModelConfig
from miles.engines.base import (
    Engine,
    GenerateRequest,
    GenerateResult,
    HealthReply,
    PauseMode,
    RequestTotals,
    SamplingParams,
)
from miles.engines.sglang_server import SGLangServer, wait_healthy
from miles.engines.sglang_update import DiskUpdate, TensorUpdate, WeightUpdate
from miles.engines.sglang_wire import ModelFacts, generate_payload, parse_generate, parse_version
from miles.engines.validate import validate_request
from miles.models.hf_io import iter_checkpoint, tensor_checksum

log = get_logger("miles.engine.sglang")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, safetensors dtype) of every tensor in a checkpoint folder (headers only)."""
    d = Path(path)
    index = d / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for fname in files:
        with safe_open(str(d / fname), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                sl = f.get_slice(k)
                out[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


class SGLangEngine(Engine):
    default_pause_mode: PauseMode = "retract"  # in_place cannot be offered (module docstring)

    def __init__(self, cfg: EngineConfig, model_path: str = "", version: int = 0) -> None:
        self.cfg = cfg
        self.model_path = model_path or cfg.sglang_model_path
        if not self.model_path:
            raise EngineError("SGLangEngine needs the served checkpoint folder (engine.sglang_model_path, "
                              "else model.path)")
        self.facts = ModelFacts.from_dir(self.model_path)
        self.max_seq_len = min(cfg.max_seq_len, self.facts.max_positions)
        self.shapes = checkpoint_shapes(self.model_path)
        self.version = version
        root = cfg.sglang_stage_dir or tempfile.mkdtemp(prefix="miles-sglang-")
        self.stage_root = Path(root)
        self.server: SGLangServer | None = None
        self.url = cfg.sglang_url.rstrip("/")
        if not self.url:
            self.server = SGLangServer(cfg, self.model_path, self.stage_root / "server.log", self.max_seq_len)
            self.server.weight_version = version
            self.url = self.server.url
        # resolved from engine.device when the section was built (core/schema/engine.py)
        self.update: WeightUpdate = (TensorUpdate(cfg.device, cfg.sglang_tp) if cfg.sglang_weight_update == "tensor"
                                     else DiskUpdate(self.stage_root, self.model_path, self._disk_committed))
        self._session: aiohttp.ClientSession | None = None
        self._ready = asyncio.Lock()
        self._started = False
        self._watchdog: asyncio.Task[None] | None = None
        self._fatal = ""  # why the server cannot serve any more (restarts exhausted / failed)
        self._inflight: dict[str, asyncio.Task[GenerateResult]] = {}
        self._aborted: set[str] = set()  # rids this client asked the server to abort
        # rids a pause('retract') hands back: their callers must see `retracted` on the result they get, so
        # the flag is set on the caller's side of generate(), before any caller can read the result
        self._retracting: set[str] = set()
        self._http: dict[str, asyncio.Future[Any]] = {}  # each request's HTTP call
        self._paused = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._staged_version: int | None = None
        self._staged: set[str] = set()
        self._closed = False
        self._last_error = ""
        self._totals = RequestTotals()

    @classmethod
    def from_config(
        cls, cfg: EngineConfig, model_cfg: ModelConfig, vocab_size: int | None = None, version: int = 0
    ) -> SGLangEngine:
        return cls(cfg, cfg.sglang_model_path or model_cfg.path, version)

    def _disk_committed(self, path: str, version: int) -> None:
        if self.server is not None:  # a restart after a crash serves this version, not the launch weights
            self.server.model_path, self.server.weight_version = path, version

    # ---- start, restart -------------------------------------------------------------
    async def warm_up(self) -> None:
        """Before the engine is registered: the server is up and has answered one request, so its
        start (60-150 s on an H200) never counts against the first requests' deadlines."""
        await self.start()
        req = GenerateRequest([0], SamplingParams(temperature=0.0, max_new_tokens=1))
        await self._call("POST", "/generate", generate_payload(req))
        log.info("sglang_engine_ready", url=self.url, version=self.version, update=self.update.kind)

    async def start(self) -> None:
        """Launch (or reach) the server and wait until it answers; called by every request (a no-op
        once up). Raises EngineStartError when it cannot start: never retried in a loop."""
        if self._fatal:
            raise EngineStartError(self._fatal)
        async with self._ready:
            if self._closed:
                raise EngineError("engine is closed")
            if self._session is None:
                timeout = aiohttp.ClientTimeout(total=self.cfg.sglang_request_timeout_s)
                # One connection per request in flight: aiohttp's default pool of 100 would hold a
                # batch of more than 100 requests back on this side, below the server's
                # --max-running-requests (max_batch_size); twice that keeps its queue full too.
                conn = aiohttp.TCPConnector(limit=max(100, 2 * self.cfg.max_batch_size))
                self._session = aiohttp.ClientSession(timeout=timeout, connector=conn)
            restarted = False
            if self.server is not None:
                try:
                    restarted = await self.server.ensure_running(self._session)
                except EngineStartError as exc:
                    first = not self._fatal
                    self._fatal = self._last_error = str(exc)
                    if first and self._started and self.on_lost is not None:
                        self.on_lost(exc)  # it had served: the role ends with this (see __init__)
                    raise
            elif not self._started:
                await wait_healthy(self._session, self.url, Deadline.after(self.cfg.sglang_startup_timeout_s))
            if restarted or not self._started:
                info = await self._call("GET", "/get_model_info")
                served = parse_version(info.get("weight_version"), "sglang /get_model_info")
                if served != self.version and self._started:
                    # a restart serves the launch weights (tensor) or a folder older than a commit made
                    # while it was down: the committed version is sent again before anything is served
                    await self.update.replay(self.version, self._call)
                    log.info("sglang_version_replayed", served=served, version=self.version)
                elif served != self.version:
                    log.info("sglang_version_adopted", configured=self.version, served=served)
                    self.version = served
            self._started = True
            if self.server is not None and self._watchdog is None:
                self._watchdog = asyncio.get_running_loop().create_task(self._watch(), name="sglang-watchdog")

    async def _watch(self, every_s: float = 1.0) -> None:
        """Restart a server that had served and died, without waiting for a request to find it
        (routing skips an engine whose health is not ok, so none might come)."""
        assert self.server is not None
        while not self._closed:
            await asyncio.sleep(every_s)
            if self.server.alive or self._closed:
                continue
            log.warning("sglang_server_died", code=self.server.exit_code(), log=str(self.server.log_path))
            try:
                await self.start()
            except EngineError as exc:
                log.error("sglang_server_lost", error=str(exc))  # start() told on_lost
                return

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        assert self._session is not None
        try:
            async with self._session.request(method, self.url + path, json=body) as r:
                text = await r.text()
                if r.status != 200:
                    raise EngineError(f"sglang {path}: HTTP {r.status}: {text[:500]}")
        except aiohttp.ClientError as exc:
            self._last_error = f"{path}: {type(exc).__name__}: {exc}"
            if self.server is not None and isinstance(exc, aiohttp.ClientConnectionError):
                # a killed server resets its connections a moment before its exit can be reaped:
                # wait for that moment, so its death is reported as such and not as this call's error
                for _ in range(20):
                    if not self.server.alive:
                        break
                    await asyncio.sleep(0.05)
            if self.server is not None and not self.server.alive:
                code = self.server.exit_code()
                raise EngineDown(f"sglang server died (exit code {code}) during {path}; it is restarted "
                                 f"(engine.sglang_max_restarts); log: {self.server.log_path}") from exc
            raise EngineError(f"sglang {path}: {type(exc).__name__}: {exc}") from exc
        try:
            return json.loads(text) if text.strip() else {}
        except json.JSONDecodeError:
            return {"text": text}  # some control endpoints (/flush_cache) answer plain text

    # ---- requests -----------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        validate_request(req, self.facts.vocab_size, self.max_seq_len)
        if req.images is not None:  # not dropped silently: the request would run without its pixels
            raise EngineError(f"request {req.request_id}: images are served by the torch engine only "
                              "(engine.type='torch'); the SGLang engine does not take them yet")
        await self.start()
        await self._resumed.wait()  # pause(): new requests wait, like the embedded engine's queue
        task = asyncio.get_running_loop().create_task(self._generate(req))
        self._inflight[req.request_id] = task
        try:
            return self._handed_back(req.request_id, await asyncio.shield(task))
        except asyncio.CancelledError:
            await self.abort(req.request_id)
            raise
        finally:
            if task.done():
                self._inflight.pop(req.request_id, None)
                self._retracting.discard(req.request_id)

    def _handed_back(self, rid: str, res: GenerateResult) -> GenerateResult:
        """`res` marked retracted when a pause('retract') aborted it. Marked here, where its caller
        resumes: pause() used to mark the results it collected after its callers had already woken,
        so the actor had sent them as plain aborts (H100, session 18: 0 rollout resubmits in 63 pushes,
        18 groups dropped as failed, mid-run evals scored truncated answers)."""
        if res.finish_reason == "abort" and rid in self._retracting:
            res.retracted = True
        return res

    async def _generate(self, req: GenerateRequest) -> GenerateResult:
        if req.return_routed_experts and self.facts.num_experts == 0:
            # A dense checkpoint routes nothing, so R3 has nothing to replay (the torch engine returns
            # no experts for it either). Asking anyway made SGLang answer without routed_experts and
            # every GSM8K request fail on Qwen2.5 (H100, session 15).
            req = dataclasses.replace(req, return_routed_experts=False)
        call = asyncio.ensure_future(self._call("POST", "/generate", generate_payload(req)))
        self._http[req.request_id] = call
        try:
            body = await call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if call.cancelled() and req.request_id in self._aborted and not (task and task.cancelling()):
                # dropped by pause(): the server held it unscheduled (module doc); nothing was delivered
                return GenerateResult(req.request_id, [], [], "abort", [], len(req.input_ids), 0)
            raise
        except EngineError:
            if req.request_id not in self._aborted:
                raise
            # An abort the server answered with an error instead of a partial result: nothing was
            # delivered, so the request finishes empty (the caller resubmits the prompt).
            return GenerateResult(req.request_id, [], [], "abort", [], len(req.input_ids), 0)
        finally:
            self._aborted.discard(req.request_id)
            self._http.pop(req.request_id, None)
        res = parse_generate(body, req, self.facts)
        self._totals.requests += 1
        self._totals.prompt += res.prompt_tokens
        self._totals.cached += res.cached_tokens
        self._totals.generated += len(res.output_ids)
        return res

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._inflight:
            return False
        self._aborted.add(request_id)
        await self._call("POST", "/abort_request", {"rid": request_id})
        return True

    async def end_session(self, key: str) -> None:
        # SGLang's radix cache reuses any matching prefix by itself; there is no per-session KV to drop.
        return None

    async def flush_cache(self) -> None:
        await self.start()
        await self._call("POST", "/flush_cache")

    async def server_info(self) -> dict[str, Any]:
        """The server's /get_server_info: the settings it actually runs with (backends, graph
        sizes, memory fraction, version)."""
        await self.start()
        info: dict[str, Any] = await self._call("GET", "/get_server_info")
        return info

    # ---- pause / weights ----------------------------------------------------------
    async def pause(self, mode: PauseMode = "retract") -> list[GenerateResult]:
        if mode == "in_place":
            raise EngineError(
                "pause(in_place) is not offered on stock SGLang 0.5.17: its responses carry one weight_version, "
                "so tokens of a request held across a commit cannot be attributed; use 'retract' or 'abort'"
            )
        if mode not in ("abort", "retract"):
            raise EngineError(f"pause: unknown mode {mode!r}; valid: abort, retract")
        self._paused = True
        self._resumed.clear()
        running = list(self._inflight.values())
        self._aborted.update(self._inflight)
        if mode == "retract":
            self._retracting.update(self._inflight)
        # SGLang's own 'retract' keeps requests on the server and resumes them after the pause, with
        # no record of where the version changed; miles' retract returns them to the caller instead,
        # which is SGLang's 'abort' plus the retracted flag (partial output is kept). A server that is
        # down runs nothing: paused already (its requests failed with EngineDown).
        if not await self._control("/pause_generation", {"mode": "abort"}):
            log.info("sglang_pause_while_down")
        await self._drop_held(running)
        out: list[GenerateResult] = []
        for t in running:
            try:
                res = await t
            except EngineError:
                continue  # its caller sees the error
            out.append(self._handed_back(res.request_id, res))
        return out

    async def _drop_held(self, running: list[asyncio.Task[GenerateResult]], quiet_s: float = 0.5) -> None:
        """Requests the scheduler had come back at once, aborted with their partial output. One that
        reached the server after the pause is held unscheduled until /continue_generation (SGLang's
        tokenizer manager waits on the pause; /abort_request cannot reach it yet), so it would never
        answer here: once answers stop coming for `quiet_s`, the remaining calls are dropped on this
        side (the caller gets an empty abort and resubmits; the server computes it after resume and
        finds the connection closed)."""
        pending = {t for t in running if not t.done()}
        while pending:
            done, pending = await asyncio.wait(pending, timeout=quiet_s, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
        for t in pending:
            rid = next((r for r, task in self._inflight.items() if task is t), None)
            call = self._http.get(rid) if rid is not None else None
            if call is not None:
                log.info("sglang_request_dropped_at_pause", request_id=rid)
                call.cancel()

    async def _control(self, path: str, body: dict[str, Any]) -> bool:
        """A control call that a down server makes moot (it restarts unpaused, on the committed
        version): False, without waiting for its restart (60-150 s, over a sync step's deadline)."""
        if self._down():
            return False
        try:
            await self._call("POST", path, body)
        except EngineDown:
            return False
        return True

    def _down(self) -> bool:
        return self.server is not None and self._started and not (self.server.alive and self.server.served)

    async def resume(self) -> None:
        await self._control("/continue_generation", {})
        self._paused = False
        self._resumed.set()

    async def stage(
        self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> int:
        if self._staged_version is not None and version != self._staged_version:
            raise EngineError(f"stage(version={version}): version {self._staged_version} is still staged; "
                              "commit or abort it first")
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        dtype = _DTYPES[self.cfg.dtype]
        bucket: dict[str, torch.Tensor] = {}
        for name, t in items:
            if name not in self.shapes:
                raise EngineError(f"stage(version={version}): unknown tensor {name!r}")
            if tuple(t.shape) != self.shapes[name][0]:
                raise EngineError(f"stage(version={version}): tensor {name!r} has shape {tuple(t.shape)}, "
                                  f"engine expects {self.shapes[name][0]}")
            bucket[name] = t.detach().to(dtype=dtype).contiguous()
        if self._staged_version is None:
            self.update.begin(version)
            self._staged_version = version
        if bucket:
            await self.update.stage(version, bucket)  # copies: the caller may reuse its tensors
            self._staged.update(bucket)
        return len(self._staged)

    async def commit(self, version: int) -> None:
        if self._staged_version != version:
            raise EngineError(f"commit(version={version}): nothing staged for it (staged: {self._staged_version})")
        missing = sorted(set(self.shapes) - self._staged)
        if missing:
            more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
            raise EngineError(f"commit(version={version}): {len(missing)} tensors not staged: "
                              f"{', '.join(missing[:3])}{more}")
        deferred = self._down()
        if not deferred:
            try:
                await self.update.commit(version, self._call)
            except EngineDown:
                deferred = True
        if deferred:  # the restart (or the replay after it) brings the server to this version
            await asyncio.to_thread(self.update.adopt, version)
        self.version, self._staged_version, self._staged = version, None, set()
        log.info("engine_weights_committed", version=version, update=self.update.kind, deferred=deferred)

    async def abort_version(self, version: int) -> None:
        if self._staged_version == version:
            self.update.abort(version)
            self._staged_version, self._staged = None, set()

    # ---- introspection ------------------------------------------------------------
    def health(self) -> HealthReply:
        alive = (self.server.alive and self.server.served) if self.server is not None else self._started
        return HealthReply(
            version=self.version, ok=alive and not self._closed and not self._fatal, paused=self._paused,
            running=len(self._inflight), queued=0, device=f"sglang {self.url}",
            restarts=self.server.restarts if self.server is not None else 0, last_error=self._last_error,
            fatal=self._fatal, weight_update=self.update.kind)

    def stats(self) -> dict[str, Any]:
        return {
            **self._totals.snapshot(),
            "running": len(self._inflight),
            "version": self.version,
        }

    async def served_checksums(self, names: Iterable[str]) -> dict[str, str]:
        """xxh64 of tensors read back from the live server (/get_weights_by_name). Only names that
        SGLang keeps unfused (embeddings, lm_head, norms, router gates) can be read this way."""
        await self.start()
        dtype = _DTYPES[self.cfg.dtype]
        out = {}
        for name in names:
            shape = self.shapes.get(name)
            if shape is None:
                raise EngineError(f"served_checksums: unknown tensor {name!r}")
            body = {"name": name, "truncate_size": shape[0][0] if shape[0] else 1}
            vals = await self._call("POST", "/get_weights_by_name", body)
            t = torch.tensor(vals, dtype=torch.float32).to(dtype)
            if tuple(t.shape) != shape[0]:
                raise EngineError(f"served_checksums: server returned shape {tuple(t.shape)} for {name!r}, "
                                  f"checkpoint has {shape[0]} (tensor-parallel shard or fused name?)")
            out[name] = tensor_checksum(t)
        return out

    def checksums(self) -> dict[str, str]:
        """xxh64 of every HF tensor of the version the server was last given (the committed buffers
        or folder; the launch checkpoint before any commit). The live copy can be checked per tensor
        with `served_checksums`."""
        return {k: tensor_checksum(v) for k, v in self.state_dict_hf().items()}

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        committed = self.update.committed()
        return committed if committed is not None else dict(iter_checkpoint(self.model_path))

    async def close(self) -> None:
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        for t in list(self._inflight.values()):
            t.cancel()
        await asyncio.gather(*self._inflight.values(), return_exceptions=True)
        self._inflight.clear()
        if self.server is not None:
            await self.server.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None
