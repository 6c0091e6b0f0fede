"""The one step that finishes a loaded `MilesConfig`: resolve, derive, check.

`MilesConfig.__post_init__` runs it, so the loader does in every process (the launcher from
TOML + `--set`, each role from the dumped JSON); each section has already checked its own
fields when it was built. Nothing downstream re-checks what is checked here, and nothing
rewrites the config at run time: a value another part needs in a different form (the weight
channel's settings under FP8, the snapshot eval engine's channel) is derived here, once.

What needs more than the config stays at launch (launch/validate.py): hooks that must import,
a model directory to read, packages that must be installed. What depends on the machine that
trains (a visible CUDA device, a MoE policy) is resolved from its facts by core/schema/runtime.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from miles.core.errors import ConfigError
from miles.core.schema.buffer import BufferConfig
from miles.core.schema.engine import EngineConfig
from miles.core.schema.eval import EvalConfig
from miles.core.schema.model import ModelConfig
from miles.core.schema.run import RunConfig
from miles.core.schema.sync import SyncConfig
from miles.core.schema.trainer import TrainerConfig, check_async_correction


class ResolvedSections(Protocol):
    """The sections of `miles.core.schema.MilesConfig` this step reads, and what it derives
    (a Protocol, so that this module does not import the one that runs it)."""

    run: RunConfig
    model: ModelConfig
    engine: EngineConfig
    buffer: BufferConfig
    trainer: TrainerConfig
    sync: SyncConfig
    eval: EvalConfig
    channel_sync: SyncConfig
    snapshot_sync: SyncConfig


def resolve(cfg: ResolvedSections) -> None:
    """'auto' and 'engine' values that depend on another section, then the derived channels."""
    if cfg.sync.pause_mode == "auto":
        cfg.sync.pause_mode = cfg.engine.default_pause_mode
    eng = cfg.engine
    if eng.type == "sglang" and not eng.sglang_url and eng.sglang_mem_fraction == 0:
        # auto: the budget of a GPU split between the servers that share it (launch/sglang_checks.py
        # holds explicit fractions to the same budget)
        share = eng.sglang_mem_budget(cfg.trainer.device != "cpu") / eng.servers_per_gpu(cfg.eval.mode == "snapshot")
        eng.sglang_mem_fraction = round(share, 3)
    # Weights travel in the engines' compute dtype unless told otherwise: the trainer casts
    # once into its export buffer, and the engines take the flat plan as it is.
    if cfg.sync.dtype == "engine":
        # LoRA adapters (and their scale) travel as exported: the engine merges them itself.
        cfg.sync.dtype = "same" if cfg.trainer.lora.rank > 0 else cfg.engine.dtype  # type: ignore[assignment]  # not "auto": EngineConfig resolved it
    # Under the FP8 contract the publisher casts (sync.dtype) and quantizes tensor by tensor; the
    # channel must move its codes + scales as given (a cast would destroy the codes; docs/fp8.md).
    fp8 = cfg.model.fp8 == "blockwise"
    cfg.channel_sync = replace(cfg.sync, dtype="same", flat_export="off") if fp8 else cfg.sync
    # the snapshot eval engine gets the last pushed version over plain zmq, and is never serving
    # training requests that a pause would have to hold
    cfg.snapshot_sync = replace(cfg.channel_sync, transport="zmq", pause_mode="none")


def check(cfg: ResolvedSections) -> None:
    """Rules across sections; ConfigError naming the options and the fix."""
    tr = cfg.trainer
    check_async_correction(tr.correction.types, asynchronous=cfg.buffer.mode != "sync")
    if tr.true_on_policy and not cfg.engine.batch_invariant:
        raise ConfigError("trainer.true_on_policy needs engine.batch_invariant = true: the engine must use "
                          "the same batch-invariant kernels for logprobs to match bit for bit")
    if tr.pause_engines and cfg.engine.type != "torch":
        raise ConfigError(f"trainer.pause_engines pauses engines in place (requests and KV kept), which "
                          f"engine.type = {cfg.engine.type!r} does not offer: use the torch engine or turn it off")
    if cfg.run.time_limit_s > 0 and tr.world_size > 1:
        raise ConfigError(f"run.time_limit_s = {cfg.run.time_limit_s}: > 0 only with one trainer rank (ranks "
                          f"would stop at different steps), got world_size {tr.world_size}")
    _check_hand_off(cfg)
    errs = fp8_errors(cfg)
    if errs:
        raise ConfigError("; ".join(errs))


def _check_hand_off(cfg: ResolvedSections) -> None:
    """The weight hand-off. A sharded sync (FSDP2 shards or megatron's tensor-/expert-parallel
    slices) keeps no whole-model snapshot; LoRA runs sync only adapters (+ their scale) and the
    engines merge them: the engine and the channel must carry them as sent."""
    if cfg.sync.sharded and cfg.eval.mode == "snapshot":
        raise ConfigError("sync.sharded: eval.mode = 'snapshot' needs the whole model on rank 0; use 'shared' "
                          "or 'external'")
    if cfg.trainer.lora.rank < 1:
        return
    if cfg.sync.sharded:
        raise ConfigError("trainer.lora.rank > 0 sends adapters, not shards: set sync.sharded = false")
    if cfg.engine.type != "torch":
        raise ConfigError(f"trainer.lora.rank > 0 needs engine.type = 'torch' (it merges synced adapters); "
                          f"got {cfg.engine.type!r}")
    if cfg.sync.transport == "disk_delta":
        raise ConfigError("trainer.lora.rank > 0: sync.transport = 'disk_delta' diffs full weights; "
                          "adapters are small, use zmq, broadcast or cuda_ipc")
    if cfg.sync.dtype not in ("same", "float32"):
        raise ConfigError(f"trainer.lora.rank > 0 needs sync.dtype = 'same' or 'float32' (the adapter scale "
                          f"travels as a number), got {cfg.sync.dtype!r}")


def fp8_errors(cfg: ResolvedSections) -> list[str]:
    """The parts of a run that do not (yet) go under the FP8 contract (empty when model.fp8 is off)."""
    if cfg.model.fp8 == "off":
        return []
    out: list[str] = []
    if cfg.trainer.backend != "fsdp":
        out.append(f"model.fp8 = 'blockwise' needs trainer.backend = 'fsdp' (the megatron backend's model does "
                   f"not fake-quantize its weights), got {cfg.trainer.backend!r}")
    if cfg.trainer.lora.rank > 0:
        out.append("model.fp8 = 'blockwise' does not combine with LoRA (trainer.lora.rank > 0): adapters cannot "
                   "be merged into FP8 engine weights")
    if cfg.engine.type != "torch":
        out.append(f"model.fp8 = 'blockwise' needs engine.type = 'torch' (the {cfg.engine.type!r} engine does not "
                   "compute with the contract's weights)")
    if cfg.sync.sharded:
        out.append("model.fp8 = 'blockwise' needs sync.sharded = false: FP8 engines take codes + scales of whole "
                   "tensors (blocks must not straddle shard boundaries)")
    return out
