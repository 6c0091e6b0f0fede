"""Config of the diffusion RL recipe (`miles diffusion CONFIG --set a.b=c`).

Typed dataclasses in core/config.py's conventions: every option has a default, a unit and a
doc; unknown keys are errors. The buffer, sync and correction sections are the LLM
recipe's own types, reused as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.core.config import opt, section
from miles.core.schema.buffer import BufferConfig
from miles.core.schema.sync import SyncConfig
from miles.core.schema.trainer import CorrectionConfig, check_async_correction


@dataclass
class DiffusionRunConfig:
    name: str = opt("diffusion", "run name, bound to every log event")
    dir: str = opt("runs/diffusion", "directory the run writes metrics, plots, sample grids and weights to", "path")
    seed: int = opt(0, "run seed: pretraining, prompts' noise seeds, trainer shuffles")
    steps: int = opt(60, "training steps (weight versions) the run makes", "steps")
    time_budget_s: float = opt(0.0, "stop after the step that ends past this much RL time; 0 = no limit", "s")
    threads: int = opt(0, "torch intra-op threads of this process; 0 = torch's default", "threads")
    log_level: Literal["debug", "info", "warning", "error"] = opt("info", "log level")
    eval_every: int = opt(10, "every N steps: a fixed-seed evaluation batch (mean reward, no training)", "steps")


@dataclass
class DiffusionModelConfig:
    channels: int = opt(16, "UNet width at full resolution (2x at half resolution); a multiple of 8", "channels")
    emb_dim: int = opt(64, "time + condition embedding width", "features")
    image_size: int = opt(16, "image side", "pixels")
    checkpoint: str = opt("", "safetensors weights to start from; '' = pretrain from scratch in the run", "path")
    pretrain_steps: int = opt(1200, "flow-matching pretraining steps when no checkpoint is given", "steps")
    pretrain_batch: int = opt(64, "pretraining batch", "images")
    pretrain_seconds: float = opt(0.0, "stop pretraining early after this long; 0 = all steps", "s")


@dataclass
class SamplerConfig:
    steps: int = opt(8, "SDE denoising steps per image (each one a recorded Gaussian transition)", "steps")
    noise_level: float = opt(0.7, "a in sigma_t = a * sqrt(t / (1 - t)): how stochastic each step is")
    condition: Literal["any", "circle", "square", "triangle"] = opt(
        "any", "the condition every prompt asks for ('any' = the null class)")
    max_batch: int = opt(256, "most trajectories the engine denoises in one batch", "trajectories")


@dataclass
class PrecisionConfig:
    deterministic: bool = opt(
        False, "bit-identical runs: deterministic torch algorithms, fixed seeds per prompt, and "
        "generation and training in lock-step (the run behaves as buffer.mode='sync', whose "
        "buffer.capacity is one batch: batch_groups * n_samples)")
    engine_dtype: Literal["float32", "bfloat16"] = opt("float32", "dtype the rollout engine holds its weights in")
    trainer_dtype: Literal["float32", "bfloat16"] = opt(
        "float32", "compute dtype of the trainer's FSDP2 units (master weights and optimizer stay FP32)")
    fp32_params: list[str] = opt(
        [], "fnmatch patterns of parameters kept in FP32 where the dtype above is BF16, e.g. "
        "['time_embed.*', 'cond_embed.*', 'conv_in.*', 'conv_out.*']; applies to engine and trainer")


@dataclass
class RewardConfig:
    fn: str = opt(
        "miles.diffusion.rewards:ClassifierReward",
        "import path of the reward: a callable `(images [N,3,H,W] in [-1,1], conditions [N]) -> "
        "rewards [N]`, or a class built with this RewardConfig; built-ins in miles.diffusion.rewards")
    target: Literal["circle", "square", "triangle"] = opt("circle", "ClassifierReward: the shape rewarded")
    classifier: str = opt("", "ClassifierReward: safetensors weights; '' = train one in the run", "path")
    classifier_steps: int = opt(300, "ClassifierReward: training steps when no weights are given", "steps")


@dataclass
class DiffusionTrainerConfig:
    lr: float = opt(3e-4, "AdamW learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(1.0, "gradient-norm clip; 0 = none")
    mini_batches: int = opt(2, "optimizer updates per step (the batch split by whole groups)", "updates")
    micro_batch: int = opt(256, "transitions per forward/backward (gradient accumulation beyond)", "transitions")
    eps_clip: float = opt(0.2, "PPO ratio clip: ratio kept in [1 - eps_clip, 1 + eps_clip] per transition")
    adv_clip: float = opt(5.0, "advantages clipped to +-this", "std")
    std_normalize: bool = opt(True, "divide group-centred rewards by the group std (false = Dr.GRPO)")
    kl_coef: float = opt(0.0, "weight of the KL to the reference (the starting policy); 0 skips the reference pass")
    correction: CorrectionConfig = section(
        CorrectionConfig, "rollout/trainer mismatch corrections over transitions (trainer/corrections.py)")


@dataclass
class DiffusionConfig:
    """The whole diffusion recipe; `miles diffusion --print-config` prints it with docs."""

    run: DiffusionRunConfig = section(DiffusionRunConfig, "run-wide settings")
    model: DiffusionModelConfig = section(DiffusionModelConfig, "the flow-matching UNet policy")
    sampler: SamplerConfig = section(SamplerConfig, "the SDE rollout sampler")
    precision: PrecisionConfig = section(PrecisionConfig, "deterministic mode and per-parameter FP32")
    reward: RewardConfig = section(RewardConfig, "the reward function")
    trainer: DiffusionTrainerConfig = section(DiffusionTrainerConfig, "GRPO over denoising trajectories")
    buffer: BufferConfig = section(BufferConfig, "bounded buffer, staleness and orchestration mode (shared with LLM runs)")
    sync: SyncConfig = section(SyncConfig, "weight handoff trainer -> engine (shared with LLM runs)")
    n_samples: int = opt(8, "trajectories per prompt (the GRPO group)", "trajectories")

    def __post_init__(self) -> None:
        if self.model.channels % 8 or self.model.channels < 8:
            raise ValueError(f"model.channels must be a positive multiple of 8, got {self.model.channels}")
        if self.sampler.steps < 2:
            raise ValueError(f"sampler.steps must be >= 2, got {self.sampler.steps}")
        if self.n_samples < 2:
            raise ValueError(f"n_samples must be >= 2 (GRPO needs a group), got {self.n_samples}")
        if self.trainer.mini_batches < 1 or self.trainer.micro_batch < 1:
            raise ValueError("trainer.mini_batches and trainer.micro_batch must be >= 1")
        # the recipe runs in lockstep (every group generated by the weights it trains) under sync or
        # deterministic mode (diffusion/recipe.py); otherwise rollouts come from older weights
        check_async_correction(self.trainer.correction.types,
                               asynchronous=not (self.buffer.mode == "sync" or self.precision.deterministic))
