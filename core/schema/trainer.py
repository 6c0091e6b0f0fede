"""Config section for the trainer: backend, advantages, loss, corrections, optimizer, schedule.

Consumed by `miles.trainer`. Each section checks its own fields when it is built (the loader
builds it), so nothing downstream checks them again; rules across sections (an asynchronous run
must choose a rollout/trainer correction) are core/schema/resolve.py's.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import ClassVar, Literal

from miles.core.config import opt, section
from miles.core.errors import ConfigError

Estimator = Literal["grpo", "gspo", "cispo", "reinforce_pp", "ppo"]
Correction = Literal["tis", "clip_or_pop", "mis", "opsm"]
# the choices' types, which the functions that take them declare too
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
KlEstimator = Literal["k1", "k2", "k3"]
OptimImpl = Literal["auto", "single", "foreach", "fused"]
ParamDtype = Literal["auto", "float32", "bfloat16"]
Recompute = Literal["off", "mlp", "full"]
_WEIGHTED = ("tis", "clip_or_pop", "mis")  # corrections that reweight the same tokens: at most one


def check_async_correction(types: list[Correction], asynchronous: bool) -> None:
    """An asynchronous run must correct for its rollouts' older weights (the orchestration mode
    lives in another section: the whole config checks this, for LLM and diffusion runs alike)."""
    if asynchronous and not types:
        raise ConfigError(
            "trainer.correction.types is empty but the run is asynchronous: rollouts come from "
            "older weights and a different engine, so logp_old != logp_rollout and the policy "
            "gradient is biased without an importance correction; choose tis, clip_or_pop or "
            "mis (and optionally opsm)")


@dataclass
class AdvantageConfig:
    estimator: Estimator = opt(
        "grpo",
        "advantage estimator: grpo (group-normalised; std switch gives Dr.GRPO), gspo "
        "(grpo advantages + sequence-level ratio), cispo (grpo advantages + clipped-IS-weight "
        "loss), reinforce_pp (global batch-normalised returns), ppo (critic + GAE)",
    )
    std_normalize: bool = opt(
        True, "divide group-centred rewards by the group std (false = Dr.GRPO)"
    )
    eps: float = opt(1e-6, "added to the std before dividing, so near-constant groups stay finite")
    gamma: float = opt(1.0, "discount for reinforce_pp returns and GAE")
    lam: float = opt(1.0, "GAE lambda (ppo only)")
    whiten: bool = opt(
        True, "ppo/reinforce_pp: normalise advantages over all loss tokens of the global batch"
    )


@dataclass
class LossConfig:
    eps_clip_low: float = opt(0.2, "PPO ratio clip below: ratio >= 1 - eps_clip_low")
    eps_clip_high: float = opt(
        0.28, "PPO ratio clip above (clip-higher): ratio <= 1 + eps_clip_high"
    )
    dual_clip_c: float = opt(
        0.0, "dual-clip bound c (> 1) for negative advantages; 0 disables dual clip"
    )
    gspo_eps_clip_low: float = opt(3e-4, "GSPO sequence-ratio clip below (gspo only)")
    gspo_eps_clip_high: float = opt(4e-4, "GSPO sequence-ratio clip above (gspo only)")
    aggregation: Aggregation = opt(
        "token_mean",
        "how per-token losses become one number: mean over all loss tokens of the global batch, "
        "mean over sequences of each sequence's token mean, or of each sequence's token sum",
    )
    kl_coef: float = opt(0.0, "weight of the KL-to-reference loss term; 0 skips the reference pass")
    kl_estimator: KlEstimator = opt("k3", "KL estimator for the reference term")
    kl_in_reward: bool = opt(
        False, "reinforce_pp/ppo: put the KL penalty into per-token rewards instead of the loss"
    )
    entropy_coef: float = opt(0.0, "weight of the entropy bonus (subtracted from the loss)")
    value_clip: float = opt(0.2, "ppo critic: clip value updates to +-value_clip around old values")
    value_coef: float = opt(0.5, "ppo critic: weight of the value loss")

    def __post_init__(self) -> None:
        if self.eps_clip_low < 0 or self.eps_clip_high < 0:
            raise ConfigError("trainer.loss.eps_clip_low/high must be >= 0")


@dataclass
class CorrectionConfig:
    types: list[Correction] = opt(
        ["tis"],
        "rollout/trainer mismatch corrections to apply, any of tis, clip_or_pop, mis, opsm "
        "(tis, clip_or_pop and mis are exclusive); an asynchronous run must choose at least one",
    )
    tis_cap: float = opt(2.0, "TIS: importance weight exp(logp_old - logp_rollout) truncated here")
    pop_low: float = opt(0.5, "Clip-or-Pop: tokens whose weight is below this get zero gradient")
    pop_high: float = opt(2.0, "Clip-or-Pop: tokens whose weight is above this get zero gradient")
    mis_level: Literal["token", "sequence", "geometric"] = opt(
        "token", "MIS: weight per token, per sequence (product) or geometric mean per sequence"
    )
    mis_mode: Literal["truncate", "mask"] = opt(
        "truncate", "MIS: truncate weights at mis_high, or mask tokens/sequences outside the bounds"
    )
    mis_low: float = opt(0.5, "MIS mask mode: lower bound of kept weights")
    mis_high: float = opt(2.0, "MIS: upper bound (truncation cap, or mask bound)")
    mis_veto: float = opt(
        1e-4, "MIS veto: a sequence with any token weight below this is dropped; 0 disables"
    )
    opsm_delta: float = opt(
        1e-4,
        "OPSM: mask a negative-advantage sequence whose mean KL(rollout || current) exceeds this",
        "nats/token",
    )
    old_logprobs: Literal["recompute", "rollout"] = opt(
        "recompute",
        "old-policy logprobs: recompute with a no-grad pass at the step's start weights, or reuse "
        "the rollout engine's (then the PPO ratio absorbs the mismatch and weights are 1)",
    )
    old_logprobs_pass: Literal["auto", "when_needed", "always"] = opt(
        "auto",
        "recompute's no-grad pass: 'when_needed' skips it in a step that makes one optimizer update "
        "and in which nothing reads old logprobs before it (the training forward's detached logprobs "
        "are the same values); 'always' runs it every step; auto = when_needed",
    )

    def __post_init__(self) -> None:
        if self.old_logprobs_pass == "auto":  # a per-step decision (how many updates the step makes)
            self.old_logprobs_pass = "when_needed"
        if len(set(self.types)) != len(self.types):
            raise ConfigError(f"trainer.correction.types: duplicates in {self.types}")
        weighted = [t for t in self.types if t in _WEIGHTED]
        if len(weighted) > 1:
            raise ConfigError(f"trainer.correction.types: {weighted} each reweight the same tokens; choose one "
                              "of tis, clip_or_pop, mis (opsm combines with any)")
        if "tis" in self.types and self.tis_cap <= 0:
            raise ConfigError(f"trainer.correction.tis_cap must be > 0, got {self.tis_cap}")
        if "clip_or_pop" in self.types and not 0 <= self.pop_low < 1 < self.pop_high:
            raise ConfigError(f"trainer.correction: need 0 <= pop_low < 1 < pop_high, got "
                              f"[{self.pop_low}, {self.pop_high}]")
        if "mis" in self.types and not 0 <= self.mis_low < 1 < self.mis_high:
            raise ConfigError(f"trainer.correction: need 0 <= mis_low < 1 < mis_high, got "
                              f"[{self.mis_low}, {self.mis_high}]")
        if "opsm" in self.types and self.opsm_delta < 0:
            raise ConfigError(f"trainer.correction.opsm_delta must be >= 0, got {self.opsm_delta}")


@dataclass
class OptimConfig:
    lr: float = opt(1e-6, "peak learning rate of AdamW")
    min_lr: float = opt(0.0, "learning rate at the end of decay")
    betas: list[float] = opt([0.9, 0.98], "AdamW betas")
    eps: float = opt(1e-8, "AdamW epsilon")
    weight_decay: float = opt(0.0, "AdamW decoupled weight decay")
    warmup_steps: int = opt(
        0, "linear warm-up from 0 to lr over this many optimizer steps", "steps"
    )
    decay_steps: int = opt(0, "steps of decay after warm-up (0 = constant after warm-up)", "steps")
    schedule: Literal["constant", "linear", "cosine"] = opt("constant", "decay shape after warm-up")
    grad_clip: float = opt(1.0, "clip the global gradient L2 norm to this; 0 disables")
    impl: OptimImpl = opt(
        "auto",
        "AdamW kernels: single = one parameter at a time (torch foreach=False; the streamed "
        "optimizer's exact math), foreach = multi-tensor kernels, fused = one fused kernel per "
        "parameter group (CUDA); auto = fused on CUDA, single on CPU (core/schema/runtime.py). They "
        "agree to fp32 rounding",
    )

    def __post_init__(self) -> None:
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"trainer.optim.betas must be two numbers in [0, 1), got {self.betas}")
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"trainer.optim: need 0 <= min_lr <= lr, got lr={self.lr} min_lr={self.min_lr}")


@dataclass
class MemoryConfig:
    optimizer: Literal["adamw", "streamed"] = opt(
        "adamw",
        "adamw: moments in device memory; streamed: moments on disk in per-bucket files, "
        "one bucket at a time through a pinned buffer (bit-identical updates)",
    )
    stream_dir: str = opt(
        "", "directory of the streamed moment files; empty = a fresh temporary directory", "path"
    )
    stream_bucket_mb: float = opt(
        256.0, "moment bytes (exp_avg + exp_avg_sq) per streamed bucket", "MiB"
    )
    offload_when_idle: bool = opt(
        False, "move all trainer state to pinned host memory as one block between steps "
        "(frees the device for a colocated engine); reloaded before the next step"
    )


@dataclass
class LoraConfig:
    rank: int = opt(0, "LoRA rank; 0 = full fine-tuning (no adapters)")
    alpha: float = opt(16.0, "LoRA scale numerator: the update is (alpha / rank) * B @ A")
    targets: list[str] = opt(
        ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
        "module names (last path component) of the linear layers that get adapters",
    )


@dataclass
class DistillConfig:
    teacher_checkpoint: str = opt(
        "", "HF checkpoint of the teacher; non-empty turns on on-policy distillation", "path"
    )
    kl_coef: float = opt(
        1.0, "weight of the per-token reverse KL (logp_student - logp_teacher) advantage"
    )
    reward_coef: float = opt(
        0.0, "weight of the task-reward advantage added to the distillation advantage"
    )


@dataclass
class MegatronConfig:
    tensor_parallel_size: int = opt(
        1, "megatron backend: tensor-parallel ranks per model replica", "ranks"
    )
    pipeline_parallel_size: int = opt(
        1, "megatron backend: pipeline stages (only 1 is implemented; more is refused)", "ranks"
    )
    expert_parallel_size: int = opt(
        1, "megatron backend: ranks the MoE experts are split over (token all-to-all)", "ranks"
    )
    transformer_impl: Literal["auto", "local", "transformer_engine"] = opt(
        "auto",
        "megatron layer spec: local (pure megatron-core modules), transformer_engine, or auto "
        "(transformer_engine when it is installed, else local)",
    )

    def __post_init__(self) -> None:
        if self.transformer_impl == "auto":  # the roles run the launcher's interpreter: the same packages
            te = importlib.util.find_spec("transformer_engine") is not None
            self.transformer_impl = "transformer_engine" if te else "local"


@dataclass
class TrainerConfig:
    backend: Literal["fsdp", "megatron"] = opt(
        "fsdp",
        "training backend: fsdp (FSDP2, miles' own model) or megatron (megatron-core GPT/MoE, "
        "optional extra `megatron`, CUDA and Python >= 3.12 only)",
    )
    world_size: int = opt(1, "trainer data-parallel ranks (one process each)", "ranks")
    device: Literal["auto", "cpu", "cuda"] = opt(
        "auto", "where to train: auto = cuda when available (NCCL; always for the megatron backend), else cpu "
        "(gloo); each trainer process resolves auto for the device it sees (core/schema/runtime.py)"
    )
    param_dtype: ParamDtype = opt(
        "auto",
        "compute dtype of forward/backward: auto = bfloat16 on cuda, float32 on cpu; "
        "master weights, optimizer state and gradient reduction stay float32",
    )
    micro_batch_tokens: int = opt(
        8192,
        "token budget of one packed micro-batch (sequences concatenated, no padding); on a GPU larger "
        "packs cost fewer kernel launches per token (H200: 32768 gave 1.2-1.6x the tokens/s of 16384, "
        "docs/models.md)",
        "tokens",
    )
    packed_attention: Literal["auto", "varlen", "masked", "by_length", "padded"] = opt(
        "auto",
        "attention over a packed micro-batch: varlen = one causal attention call per sequence (flash "
        "kernels on CUDA; memory and work follow the sequences' lengths), masked = one call over the "
        "whole pack with a block-diagonal mask (quadratic in micro_batch_tokens), by_length = varlen on "
        "CUDA for packs of >= 8192 tokens (H200: 1.73x at 16k-token packs, 0.87x at 4k), else masked; "
        "auto = by_length on CUDA, masked elsewhere; layers with sliding windows, sinks, MLA or linear "
        "attention use the mask; "
        "padded = no packing: the micro-batch's sequences as rows right-padded to the longest, plain "
        "causal attention (the fewest kernel calls for many short sequences, e.g. on CPU; the padding "
        "costs compute in every layer)",
    )
    compile: Literal["auto", "on", "try", "off"] = opt(
        "auto",
        "torch.compile the policy's block pieces (fused norms, residual adds and dense SwiGLU) and "
        "the chunked LM head's softmax math (CausalLM.compile_blocks); attention and MoE dispatch stay "
        "eager; the first step compiles (tens of seconds). try = on, but a compile error falls back to eager "
        "with a logged error (on raises it). auto = try for a dense model on CUDA outside true-on-policy "
        "mode, off otherwise (core/schema/runtime.py). H200 (bench/results/trainer_h200_s6.txt): dense 0.5B 1.15x "
        "at 1k-token and 1.30x at 4k-token sequences, small MoE 0.88x / 1.07x (MoE blocks have no dense "
        "SwiGLU to fuse, and the varying pack lengths recompile), hence off for MoE under auto",
    )
    mini_batches: int = opt(
        1,
        "optimizer steps per train_step: the batch is split into this many mini-batches; "
        "gradients accumulate over the packed micro-batches of each one",
        "steps",
    )
    routing_replay: bool = opt(
        True, "R3: replay the engine's recorded routed experts in MoE layers"
    )
    deterministic: bool = opt(False, "use deterministic torch algorithms (for exact-resume tests)")
    checkpoint_interval: int = opt(0, "save a checkpoint every this many steps; 0 = never", "steps")
    advantage: AdvantageConfig = section(AdvantageConfig, "advantage estimator and its options")
    loss: LossConfig = section(LossConfig, "policy loss, clipping, KL, entropy, aggregation")
    correction: CorrectionConfig = section(
        CorrectionConfig, "rollout/trainer mismatch corrections (TIS, Clip-or-Pop, MIS, OPSM)"
    )
    optim: OptimConfig = section(OptimConfig, "AdamW, gradient clipping and LR schedule")
    recompute: Recompute = opt(
        "off",
        "activation checkpointing when memory needs it: mlp = each block's MLP (or experts) keeps only "
        "its input and runs again in the backward (the block's largest activations, [tokens, 2 x "
        "intermediate]); full = whole blocks keep only their input (the least memory, one more "
        "forward of compute); gradients are unchanged",
    )
    recompute_layers: int = opt(
        0, "recompute only the first N blocks (the rest keep their activations); 0 = every block", "blocks"
    )
    pause_engines: bool = opt(
        False,
        "rank 0 pauses the engines in place (requests and KV stay) while the ranks compute a train "
        "step and resumes them right after: on a GPU that engine and trainer share, the step then "
        "runs alone instead of time-sliced with decode, and generation runs alone between steps "
        "(docs/orchestration.md; on one H200 it measured 1.41x sync against 1.55x without pausing: "
        "for pairs whose step does not fit beside a full decode batch); torch engines only",
    )
    true_on_policy: bool = opt(
        False,
        "batch-invariant forward (fixed-shape GEMM tiles, fixed-length attention, one sequence "
        "per forward) so trainer logprobs equal the engine's bit for bit; the engine must run "
        "with batch_invariant too",
    )
    memory: MemoryConfig = section(MemoryConfig, "optimizer-state streaming")
    lora: LoraConfig = section(LoraConfig, "low-rank adapters (LoRA RL)")
    distill: DistillConfig = section(DistillConfig, "on-policy distillation from a teacher")
    megatron: MegatronConfig = section(
        MegatronConfig, "megatron backend: tensor / pipeline / expert parallel sizes, layer spec"
    )
    batch_timeout_s: float = opt(
        1200.0, "longest a trainer rank waits for its next batch from the rollout side (in sync mode "
        "that covers generating the whole batch); past it the step fails with PeerTimeout", "s"
    )
    pause_timeout_s: float = opt(
        30.0, "deadline of each engine's pause and resume ask around the train step "
        "(trainer.pause_engines); an engine that misses it is counted and skipped", "s"
    )

    # Keys that were removed, with where their setting lives now (core/config.py reports them).
    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "temperature": "each sample carries the temperature it was sampled at (rollout.temperature, a "
                       "prompt's own sampling or an HTTP request's) and the trainer takes its logprobs under that",
    }

    def __post_init__(self) -> None:
        if self.micro_batch_tokens < 1 or self.mini_batches < 1:
            raise ConfigError("trainer.micro_batch_tokens and trainer.mini_batches must be >= 1")
        for name in ("batch_timeout_s", "pause_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"trainer.{name} must be > 0, got {getattr(self, name)}")
        if self.recompute_layers < 0:
            raise ConfigError(f"trainer.recompute_layers={self.recompute_layers}: expected a block count >= 0 "
                              "(0 = every block)")
        if self.backend == "megatron":
            self._check_megatron()

    def _check_megatron(self) -> None:
        """What the megatron backend does not run (its parallel sizes are checked against the
        model where the model is known: trainer/megatron/build.py check_parallel)."""
        if self.device == "cpu":
            raise ConfigError("trainer.backend='megatron' needs trainer.device = 'cuda' or 'auto'")
        if self.recompute != "off":
            raise ConfigError(f"trainer.recompute={self.recompute!r} is the FSDP backend's block checkpointing; "
                              "the megatron backend does not map it to megatron-core's recompute yet: set 'off'")
        unsupported = {
            "trainer.lora.rank > 0": self.lora.rank > 0,
            "trainer.advantage.estimator = 'ppo' (critic)": self.advantage.estimator == "ppo",
            "trainer.distill.teacher_checkpoint": bool(self.distill.teacher_checkpoint),
            "trainer.true_on_policy": self.true_on_policy,
        }
        for what, on in unsupported.items():
            if on:
                raise ConfigError(f"{what} is not supported by trainer.backend='megatron'; use 'fsdp'")
