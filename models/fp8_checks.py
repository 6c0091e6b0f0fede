"""Launch checks for the FP8 contract: the parts of a run that do not (yet) go under it.

`fp8_launch_errors(cfg)` lists every conflict with `model.fp8 = "blockwise"`, one message
each naming the option and the fix; the launcher raises them before any process starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.core.schema import MilesConfig


def fp8_launch_errors(cfg: MilesConfig) -> list[str]:
    """Conflicts of a `MilesConfig` with the FP8 contract (empty when model.fp8 is off)."""
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
    if getattr(cfg.sync, "sharded", False):
        out.append("model.fp8 = 'blockwise' needs sync.sharded = false: FP8 engines take codes + scales of whole "
                   "tensors (blocks must not straddle shard boundaries)")
    return out
