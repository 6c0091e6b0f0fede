"""Launch-time checks of the trainer's settings, kept free of torch so the launcher (which
validates a config before any role starts) does not import it: ~1 s of CPU per launch.

`check_trainer_config` is the FSDP backend's cross-field check; `check_correction_config`
that of the rollout/trainer mismatch corrections (trainer/corrections.py).
"""

from __future__ import annotations

from miles.core.errors import ConfigError
from miles.core.schema.trainer import CorrectionConfig, TrainerConfig

_WEIGHTED = ("tis", "clip_or_pop", "mis")


def check_trainer_config(cfg: TrainerConfig, asynchronous: bool, world: int) -> None:
    """Cross-field checks; raise ConfigError naming the field."""
    if cfg.backend != "fsdp":
        raise ConfigError(f"trainer.backend={cfg.backend!r}: FSDPTrainer only runs 'fsdp'")
    if world < 1 or (cfg.world_size and world != cfg.world_size):
        raise ConfigError(f"trainer.world_size={cfg.world_size} but {world} ranks were started")
    if cfg.micro_batch_tokens < 1 or cfg.mini_batches < 1:
        raise ConfigError("trainer.micro_batch_tokens and trainer.mini_batches must be >= 1")
    if cfg.recompute_layers < 0:  # (trainer.recompute itself: the loader takes only its Literal's values)
        raise ConfigError(f"trainer.recompute_layers={cfg.recompute_layers}: expected a block count >= 0 "
                          "(0 = every block)")
    if cfg.loss.eps_clip_low < 0 or cfg.loss.eps_clip_high < 0:
        raise ConfigError("trainer.loss.eps_clip_low/high must be >= 0")
    check_correction_config(cfg.correction, asynchronous)


def check_correction_config(cfg: CorrectionConfig, asynchronous: bool) -> None:
    """Reject configs that cannot be right; `asynchronous` is the run's orchestration mode."""
    if len(set(cfg.types)) != len(cfg.types):
        raise ConfigError(f"trainer.correction.types: duplicates in {cfg.types}")
    weighted = [t for t in cfg.types if t in _WEIGHTED]
    if len(weighted) > 1:
        raise ConfigError(
            f"trainer.correction.types: {weighted} each reweight the same tokens; choose one of "
            "tis, clip_or_pop, mis (opsm combines with any)"
        )
    if asynchronous and not cfg.types:
        raise ConfigError(
            "trainer.correction.types is empty but the run is asynchronous: rollouts come from "
            "older weights and a different engine, so logp_old != logp_rollout and the policy "
            "gradient is biased without an importance correction; choose tis, clip_or_pop or "
            "mis (and optionally opsm)"
        )
    if "tis" in cfg.types and cfg.tis_cap <= 0:
        raise ConfigError(f"trainer.correction.tis_cap must be > 0, got {cfg.tis_cap}")
    if "clip_or_pop" in cfg.types and not 0 <= cfg.pop_low < 1 < cfg.pop_high:
        raise ConfigError(
            f"trainer.correction: need 0 <= pop_low < 1 < pop_high, got [{cfg.pop_low}, {cfg.pop_high}]"
        )
    if "mis" in cfg.types and not 0 <= cfg.mis_low < 1 < cfg.mis_high:
        raise ConfigError(
            f"trainer.correction: need 0 <= mis_low < 1 < mis_high, got [{cfg.mis_low}, {cfg.mis_high}]"
        )
    if "opsm" in cfg.types and cfg.opsm_delta < 0:
        raise ConfigError(f"trainer.correction.opsm_delta must be >= 0, got {cfg.opsm_delta}")


def compile_enabled(cfg: TrainerConfig, device_type: str, is_moe: bool) -> bool:
    """`trainer.compile` resolved: auto compiles only where it measured faster (a dense model
    on CUDA) and never under true-on-policy, whose invariant kernels replace the block ops."""
    if cfg.compile == "auto":
        return device_type == "cuda" and not is_moe and not cfg.true_on_policy
    return cfg.compile == "on"
