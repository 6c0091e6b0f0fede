"""Config section for rollout engines: type, count, placement, batching and KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.core.config import opt
from miles.core.errors import ConfigError


@dataclass
class EngineConfig:
    type: str = opt("torch", "engine implementation: torch (embedded) | sglang (external server)")
    num_engines: int = opt(1, "number of engine processes")
    device: str = opt("cpu", "torch device of the embedded engine: cpu | cuda | cuda:N")
    dtype: Literal["float32", "bfloat16", "float16"] = opt("float32", "compute dtype of the engine")
    max_batch_size: int = opt(32, "most sequences decoded together in one step", "sequences")
    max_seq_len: int = opt(4096, "longest prompt + completion a request may reach", "tokens")
    kv_budget_tokens: int = opt(
        65536, "tokens of idle session KV kept for prefix reuse before LRU eviction", "tokens"
    )
    pause_mode: Literal["abort", "retract", "in_place"] = opt(
        "in_place", "what pause() does to running requests around a weight update"
    )
    max_queue: int = opt(4096, "most requests waiting for a batch slot; more are refused", "requests")

    def __post_init__(self) -> None:
        for name in ("num_engines", "max_batch_size", "max_seq_len", "max_queue"):
            if getattr(self, name) < 1:
                raise ConfigError(f"engine.{name}={getattr(self, name)} must be >= 1")
        if self.kv_budget_tokens < 0:
            raise ConfigError(f"engine.kv_budget_tokens={self.kv_budget_tokens} must be >= 0")
        if self.dtype == "float16" and self.device == "cpu":
            raise ConfigError("engine.dtype=float16 is not supported on cpu; use float32 or bfloat16")
