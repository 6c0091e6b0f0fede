"""The full config schema: one section module per subsystem, composed into `MilesConfig`.

Sections live in core so that every package can import its own section's type
without importing the package that owns another one.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.core.config import section
from miles.core.schema.buffer import BufferConfig
from miles.core.schema.engine import EngineConfig
from miles.core.schema.eval import EvalConfig
from miles.core.schema.model import ModelConfig
from miles.core.schema.resolve import check, resolve
from miles.core.schema.reward_model import RewardModelConfig
from miles.core.schema.rollout import RolloutConfig
from miles.core.schema.run import RunConfig
from miles.core.schema.sync import SyncConfig
from miles.core.schema.trainer import TrainerConfig
from miles.core.schema.transport import TransportConfig


class Derived:
    """What the loader derives from the sections (core/schema/resolve.py): not TOML keys, so
    not dataclass fields (dumps, `miles config` and `--set` never see them)."""

    channel_sync: SyncConfig  # the gathered weight channel's settings (under FP8: moves tensors as given)
    snapshot_sync: SyncConfig  # the snapshot eval engine's channel (zmq, no pause)


@dataclass
class MilesConfig(Derived):
    """Everything one run needs; `miles config` prints it with docs."""

    run: RunConfig = section(RunConfig, "run-wide settings: name, output directory, seed, logging")
    transport: TransportConfig = section(TransportConfig, "wire settings: sockets, heartbeats, security")
    model: ModelConfig = section(ModelConfig, "the policy model: architecture, checkpoint, dtype")
    engine: EngineConfig = section(EngineConfig, "rollout engines: type, count, batching, KV cache")
    rollout: RolloutConfig = section(RolloutConfig, "rollout layers, environment, sessions, router")
    buffer: BufferConfig = section(BufferConfig, "bounded buffer, staleness and orchestration mode")
    trainer: TrainerConfig = section(TrainerConfig, "trainer backend, losses, corrections, optimizer")
    sync: SyncConfig = section(SyncConfig, "weight handoff: transport, bucket size, deadlines")
    eval: EvalConfig = section(EvalConfig, "evaluation during training: shared, snapshot or external")
    reward_model: RewardModelConfig = section(RewardModelConfig, "judge engine pool: a frozen model served for rewards")

    def __post_init__(self) -> None:
        resolve(self)  # the one step after the sections are built (core/schema/resolve.py)
        check(self)
