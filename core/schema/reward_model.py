"""Config section for the judge engine pool: a frozen model served by its own engines, for rewards."""

from __future__ import annotations

from dataclasses import dataclass, replace

from miles.core.config import opt
from miles.core.errors import ConfigError
from miles.core.schema.engine import EngineConfig
from miles.core.schema.model import ModelConfig


@dataclass
class RewardModelConfig:
    num_engines: int = opt(
        0, "judge engines to start (each its own process, named judge-0, judge-1, ...; never sent weight "
        "updates; restarted by the supervisor like the policy's engines); 0 = no judge pool", "engines")
    path: str = opt(
        "", "HF checkpoint directory of the judge model; '' = the policy's initial checkpoint (model.path), "
        "frozen", "path")
    device: str = opt("", "torch device of the judge engines; '' = engine.device")
    max_batch_size: int = opt(16, "most judge requests decoded together in one step", "sequences")
    max_seq_len: int = opt(0, "longest judge prompt + answer; 0 = engine.max_seq_len", "tokens")
    max_new_tokens: int = opt(8, "most tokens of one judge answer", "tokens")
    timeout_s: float = opt(30.0, "deadline of one judge call attempt (routing, queueing and decoding)", "s")
    retries: int = opt(2, "attempts after the first for a judge call that failed or timed out", "attempts")
    retry_backoff_s: float = opt(0.5, "wait before a retry (doubled at each one)", "s")
    live_wait_s: float = opt(
        5.0, "how long a judge call waits for a live judge engine (all down: dead or restarting) before "
        "the attempt fails", "s")

    def __post_init__(self) -> None:
        for name in ("num_engines", "retries", "max_seq_len"):
            if getattr(self, name) < 0:
                raise ConfigError(f"reward_model.{name}={getattr(self, name)} must be >= 0")
        if self.max_batch_size < 1 or self.max_new_tokens < 1:
            raise ConfigError("reward_model.max_batch_size and reward_model.max_new_tokens must be >= 1")
        for name in ("timeout_s", "live_wait_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"reward_model.{name}={getattr(self, name)} must be > 0")
        if self.retry_backoff_s < 0:
            raise ConfigError(f"reward_model.retry_backoff_s={self.retry_backoff_s} must be >= 0")

    def engine_config(self, engine: EngineConfig) -> EngineConfig:
        """The judge engines' config: the embedded torch engine, on the policy engines' settings
        but for this section's device, batch and length (and no session KV to keep)."""
        return replace(engine, type="torch", num_engines=self.num_engines, device=self.device or engine.device,
                       max_batch_size=self.max_batch_size, max_seq_len=self.max_seq_len or engine.max_seq_len,
                       mps_thread_percent=0)

    def model_config(self, model: ModelConfig) -> ModelConfig:
        """The judge's model: this section's checkpoint, else the policy's initial one."""
        return replace(model, path=self.path or model.path, fp8="off")
