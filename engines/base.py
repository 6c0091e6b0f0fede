"""The rollout engine contract: request/result records and the `Engine` interface.

Logprob definition (shared with the trainer through `miles.models.logprobs.token_logprobs`):
the log-probability of each sampled token under softmax(logits / temperature), the
temperature-scaled distribution BEFORE top-p / top-k truncation; temperature 0 (greedy)
counts as 1.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from miles.core.clock import new_id

# The result record is core's (the rollout reads it too, and imports only core): named here as the contract's.
from miles.core.generation import FinishReason as FinishReason
from miles.core.generation import GenerateResult as GenerateResult
from miles.core.hooks import Registry
from miles.core.images import ImageInput
from miles.engines.health import HealthReply as HealthReply

# Staging: the landing an engine offers (weightsync/stager.py), named by the contract below
from miles.weightsync.stager import Staging

PauseMode = Literal["abort", "retract", "in_place"]



ENGINES = Registry(
    "engine",
    {
        "torch": "miles.engines.torch_engine:TorchEngine",
        "sglang": "miles.engines.sglang:SGLangEngine",
    },
)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # None = a fresh random seed


@dataclass
class GenerateRequest:
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session_key: str | None = None  # keeps this session's KV for the next turn (prefix reuse)
    return_routed_experts: bool = False
    request_id: str = field(default_factory=lambda: new_id("req-"))
    # every image of input_ids, in order (a VL model); the ids hold each image's placeholders
    # already expanded (core/images.py), so engine and trainer see the same token ids
    images: ImageInput | None = None


class Engine(abc.ABC):
    """What every rollout engine offers (torch embedded, sglang external)."""

    def staging(self) -> Staging | None:
        """The engine's in-place landing, or None: it takes weights only through `stage()`."""
        return None

    # what sync.pause_mode = "auto" means for this engine (a pause that keeps every token attributable)
    default_pause_mode: PauseMode = "in_place"
    # Called when the engine can no longer serve and cannot be brought back (an external server past
    # its restarts, or a restart that failed at start); the engine role sets it to end with that
    # cause. An embedded engine never calls it: its failures raise in the call that met them.
    on_lost: Callable[[BaseException], None] | None = None

    @abc.abstractmethod
    async def generate(self, req: GenerateRequest) -> GenerateResult: ...

    @abc.abstractmethod
    async def pause(self, mode: PauseMode = "in_place") -> list[GenerateResult]:
        """Stop stepping. abort/retract finish running and queued requests (returned here too,
        and to their generate() callers); in_place holds them with their KV until resume()."""

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    async def abort(self, request_id: str) -> bool:
        """Finish one request with reason 'abort'; False if it is not queued or running."""

    @abc.abstractmethod
    async def stage(
        self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> int:
        """Stage one bucket of HF-named tensors for `version`; returns tensors staged so far."""

    @abc.abstractmethod
    async def commit(self, version: int) -> None:
        """Swap the staged `version` in atomically, between two forward passes."""

    @abc.abstractmethod
    async def abort_version(self, version: int) -> None: ...

    @abc.abstractmethod
    async def end_session(self, key: str) -> None: ...

    @abc.abstractmethod
    def health(self) -> HealthReply: ...

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def checksums(self) -> dict[str, str]:
        """xxh64 hex digest of every weight's raw bytes, keyed by HF tensor name."""

    @abc.abstractmethod
    def state_dict_hf(self) -> dict[str, torch.Tensor]: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def warm_up(self) -> None:
        """Work to do before serving (compiles, graph captures), so that it does not count against
        the first requests' deadlines; by default nothing."""
        return None


class RequestTotals:
    """Counters every engine keeps for `stats()`: prompt, cached and generated tokens, requests.

    `snapshot()` also gives the generation rate since the previous snapshot.
    """

    def __init__(self) -> None:
        import time

        self._clock = time.monotonic
        self.prompt = self.cached = self.generated = self.requests = 0
        self._mark = (self._clock(), 0)

    def snapshot(self) -> dict[str, float]:
        now = self._clock()
        t0, g0 = self._mark
        self._mark = (now, self.generated)
        return {
            "tokens_per_s": (self.generated - g0) / max(now - t0, 1e-9),
            "prefix_hit_rate": self.cached / self.prompt if self.prompt else 0.0,
            "prompt_tokens": self.prompt,
            "prefix_cached_tokens": self.cached,
            "generated_tokens": self.generated,
            "requests": self.requests,
        }
