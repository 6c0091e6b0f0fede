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
from miles.core.schema.rollout import RolloutConfig
from miles.core.schema.run import RunConfig
from miles.core.schema.sync import SyncConfig
from miles.core.schema.trainer import TrainerConfig
from miles.core.schema.transport import TransportConfig


@dataclass
class MilesConfig:
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

    def __post_init__(self) -> None:
        if self.sync.pause_mode == "auto":
            self.sync.pause_mode = self.engine.default_pause_mode  # type: ignore[assignment]
        eng = self.engine
        if eng.type == "sglang" and not eng.sglang_url and eng.sglang_mem_fraction == 0:
            # auto: the budget of a GPU split between the servers that share it (launch/sglang_checks.py
            # holds explicit fractions to the same budget)
            share = eng.sglang_mem_budget(self.trainer.device != "cpu") / eng.servers_per_gpu(self.eval.mode == "snapshot")
            eng.sglang_mem_fraction = round(share, 3)
        # Weights travel in the engines' compute dtype unless told otherwise: the trainer casts
        # once into its export buffer, and the engines take the flat plan as it is.
        if self.sync.dtype == "engine":
            # LoRA adapters (and their scale) travel as exported: the engine merges them itself.
            self.sync.dtype = "same" if self.trainer.lora.rank > 0 else self.engine.dtype
