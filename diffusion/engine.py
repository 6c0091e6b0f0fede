"""`DiffusionEngine`: the rollout engine of a diffusion policy, behind the LLM engines' contract.

What it shares with them (engines/base.py): weight versions, staged weights swapped in
atomically between two forward passes (weightsync/stager.py's `WeightStager`, so every bulk
transport that lands buckets on an LLM engine lands them here), pause / resume, checksums.
What differs: a request is an image to denoise, `(condition, seed)`, not a token prompt, so
`denoise()` replaces `generate()` (which refuses, naming the right call).

Batching: requests queue; one worker denoises up to `max_batch` of them together, one SDE
step at a time. Between two steps it honours a pause and lets a commit swap the weights,
so (as with tokens) each denoising step records the weight version that produced it.
Pause modes: in_place holds running trajectories until resume; abort and retract finish
them as aborted (a partly denoised latent is not resubmitted; the buffer retries the prompt).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from miles.core.clock import new_id
from miles.core.errors import EngineError
from miles.core.logging import get_logger
from miles.diffusion.sampler import (
    SDESchedule,
    gaussian_logprob,
    initial_noise,
    step_mean_std,
    step_noise,
)
from miles.engines.base import (
    Engine,
    GenerateRequest,
    GenerateResult,
    HealthReply,
    PauseMode,
    Staging,
)
from miles.models.hf_io import tensor_checksum
from miles.weightsync.stager import WeightStager

log = get_logger("miles.diffusion.engine")


@dataclass
class DenoiseRequest:
    condition: int
    seed: int
    request_id: str = field(default_factory=lambda: new_id("img-"))


@dataclass
class DenoiseResult:
    request_id: str
    condition: int
    seed: int
    latents: np.ndarray  # [steps + 1, C, H, W] float32; [-1] is the image
    logprobs: np.ndarray  # [steps] float32, per-element mean Gaussian log-density of each transition
    versions: np.ndarray  # [steps] int64, weight version of each step
    aborted: bool = False

    def to_wire(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Running:
    req: DenoiseRequest
    fut: asyncio.Future[DenoiseResult]
    gen: torch.Generator
    latents: list[torch.Tensor] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class DiffusionEngine(Engine):
    """Denoises batches of images with the SDE sampler; `net` is the served FlowUNet."""

    model = None  # no miles model: its staging slots are not bound to one (`Staging.model`)

    def __init__(self, net: torch.nn.Module, sched: SDESchedule, max_batch: int = 256,
                 version: int = 0) -> None:
        if max_batch < 1:
            raise EngineError(f"diffusion engine: max_batch must be >= 1, got {max_batch}")
        self.net = net.eval()
        self.sched, self.max_batch, self.version = sched, max_batch, version
        s: Any = net.spec  # a FlowUNetSpec: the net is any module that carries one
        self.shape = (s.in_channels, s.image_size, s.image_size)
        self.stager = WeightStager({n: p.data for n, p in net.named_parameters()})
        self._queue: list[_Running] = []
        self._running: list[_Running] = []
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._wake = asyncio.Event()
        self._step_lock = asyncio.Lock()  # a forward pass and a commit never overlap
        self._worker: asyncio.Task[None] | None = None
        self._closed = False
        self.totals = {"requests": 0, "images": 0, "steps": 0, "aborted": 0}
        self._t0 = time.monotonic()

    # ---------------------------------------------------------------- sampling
    async def denoise(self, reqs: list[DenoiseRequest]) -> list[DenoiseResult]:
        """Denoise every request (batched with whatever else is queued); results in order."""
        if self._closed:
            raise EngineError("diffusion engine is closed")
        loop = asyncio.get_running_loop()
        futs = []
        for r in reqs:
            fut: asyncio.Future[DenoiseResult] = loop.create_future()
            gen = torch.Generator().manual_seed(r.seed ^ 0x5DEECE66D)  # same stream as sampler.sample_sde
            self._queue.append(_Running(r, fut, gen))
            futs.append(fut)
        self.totals["requests"] += len(reqs)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._work())
        self._wake.set()
        return list(await asyncio.gather(*futs))

    async def _work(self) -> None:
        while not self._closed:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
            self._running = batch
            try:
                await self._denoise_batch(batch)
            except Exception as exc:  # noqa: BLE001 - every waiting caller gets the error
                log.error("denoise_failed", error=str(exc), batch=len(batch))
                for r in batch:
                    if not r.fut.done():
                        r.fut.set_exception(EngineError(f"denoise failed: {exc}"))
            finally:
                self._running = []

    async def _denoise_batch(self, batch: list[_Running]) -> None:
        x = initial_noise([r.req.seed for r in batch], self.shape)
        cond = torch.tensor([r.req.condition for r in batch], dtype=torch.long)
        for r, xi in zip(batch, x, strict=True):
            r.latents.append(xi)
        ts = self.sched.times()
        for i in range(self.sched.steps):
            await self._resumed.wait()
            live = [j for j, r in enumerate(batch) if not r.fut.done()]
            if not live:
                return
            if len(live) < len(batch):  # some were aborted while paused
                batch = [batch[j] for j in live]
                x, cond = x[live], cond[live]
            async with self._step_lock:
                version = self.version
                x, lp = await asyncio.to_thread(self._step, x, cond, ts[i], ts[i + 1], batch)
            self.totals["steps"] += 1
            for j, r in enumerate(batch):
                r.latents.append(x[j])
                r.logprobs.append(float(lp[j]))
                r.versions.append(version)
        for r in batch:
            if not r.fut.done():
                r.fut.set_result(self._result(r, aborted=False))
                self.totals["images"] += 1

    @torch.no_grad()
    def _step(self, x: torch.Tensor, cond: torch.Tensor, t: torch.Tensor, s: torch.Tensor,
              batch: list[_Running]) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        tt, ss = t.expand(n), s.expand(n)
        v = self.net(x, tt, cond)
        mean, std = step_mean_std(x, v, tt, ss, self.sched)
        x_next = mean + std * step_noise([r.gen for r in batch], self.shape)
        return x_next, gaussian_logprob(x_next, mean, std)

    def _result(self, r: _Running, aborted: bool) -> DenoiseResult:
        return DenoiseResult(
            r.req.request_id, r.req.condition, r.req.seed,
            torch.stack(r.latents).numpy(), np.asarray(r.logprobs, np.float32),
            np.asarray(r.versions, np.int64), aborted)

    def _abort_all(self) -> list[DenoiseResult]:
        out = []
        for r in self._running + self._queue:
            if not r.fut.done():
                res = self._result(r, aborted=True)
                r.fut.set_result(res)
                out.append(res)
        self._queue = []
        self.totals["aborted"] += len(out)
        return out

    # ---------------------------------------------------------------- the engine contract
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        raise EngineError("the diffusion engine denoises images: call denoise() (message "
                          "diffusion.Denoise), not generate()")

    async def pause(self, mode: PauseMode = "in_place") -> list[GenerateResult]:
        self._resumed.clear()
        if mode in ("abort", "retract"):
            n = len(self._abort_all())
            log.info("diffusion_pause_aborted", mode=mode, trajectories=n)
        return []

    async def resume(self) -> None:
        self._resumed.set()

    async def abort(self, request_id: str) -> bool:
        for r in self._running + self._queue:
            if r.req.request_id == request_id and not r.fut.done():
                r.fut.set_result(self._result(r, aborted=True))
                self.totals["aborted"] += 1
                return True
        return False

    async def stage(self, version: int,
                    named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> int:
        if version <= self.version:
            raise EngineError(f"stage(version={version}): engine already serves version {self.version}")
        return self.stager.stage(version, named_tensors)

    def staging(self) -> Staging:
        """Its staging slots take buckets and byte ranges in place (no miles model: `model` None)."""
        return self

    def mark_staged(self, version: int, names: list[str]) -> int:
        return self.stager.mark_staged(version, names)

    async def commit(self, version: int) -> None:
        self.stager.check_complete(version)
        async with self._step_lock:  # between two denoising steps
            self.stager.apply()
            self.version = version
        log.info("diffusion_weights_committed", version=version)

    async def abort_version(self, version: int) -> None:
        if self.stager.version == version:
            self.stager.drop()

    async def end_session(self, key: str) -> None:
        """Diffusion requests keep no state between calls: nothing to end."""

    def health(self) -> HealthReply:
        return HealthReply(version=self.version, ok=not self._closed, paused=not self._resumed.is_set(),
                           running=len(self._running), queued=len(self._queue))

    def stats(self) -> dict[str, Any]:
        dt = max(time.monotonic() - self._t0, 1e-9)
        return dict(self.totals) | {"images_per_s": self.totals["images"] / dt, "version": self.version}

    def checksums(self) -> dict[str, str]:
        return {n: tensor_checksum(p.data) for n, p in self.net.named_parameters()}

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        return {n: p.data.clone() for n, p in self.net.named_parameters()}

    async def close(self) -> None:
        self._closed = True
        self._abort_all()
        self._resumed.set()  # a worker held by an in-place pause must see the close
        self._wake.set()
        if self._worker is not None:
            await asyncio.gather(self._worker, return_exceptions=True)
