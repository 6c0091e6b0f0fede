"""`FSDPTrainer`: one data-parallel rank of the FSDP2 backend, as a plain class.

The actor shell wraps it: construct once per rank, call `train_step(shard)` with this
rank's shard of the global batch (whole groups; see `batch.shard_batch`), read the
returned metrics, and stream `export_hf_state()` into weight sync. Every rank must make
the same calls in the same order (they are collectives).

The step itself is `RLStep` (trainer/rl_step.py), shared with the megatron backend; this
class is its `StepBackend`: the FSDP2-sharded models, their forward, the collectives over
all ranks and the clip-and-step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from miles.core.errors import TrainerError
from miles.core.logging import get_logger
from miles.core.schema.runtime import RuntimeFacts, resolve_trainer
from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.trainer import checkpoint
from miles.trainer.batch import TrainBatch
from miles.trainer.config_checks import check_world
from miles.trainer.deterministic import enable_deterministic
from miles.trainer.dist import Collectives, ensure_process_group, pick_device
from miles.trainer.distill import load_teacher
from miles.trainer.forward import ForwardOut, RouterProbe, packed_forward, padded_forward
from miles.trainer.lora import (
    apply_lora,
    export_merged,
    iter_adapter_payload,
    iter_adapters,
    iter_merged_hf_state,
)
from miles.trainer.nonfinite import nonfinite_params, skip_nonfinite
from miles.trainer.optim import lr_at, set_lr
from miles.trainer.optim_stream import build_optimizer
from miles.trainer.packing import MicroBatch
from miles.trainer.rank_state import Offloader, load_rank, save_rank
from miles.trainer.rl_step import RLStep
from miles.trainer.sharding import build_policy, compute_dtype, is_dtensor, make_mesh, shard, wraps
from miles.trainer.true_on_policy import invariant_forward
from miles.trainer.value import ValueModel
from miles.weightsync.flat import FlatWeights
from miles.weightsync.flat_export import FlatExportBuffer, ShardExportBuffer
from miles.weightsync.shard_plan import ShardExport

log = get_logger("trainer.fsdp")


class FSDPTrainer:
    """One FSDP2 rank. `model_spec` is the policy architecture (`ModelSpec.from_hf`).

    A single rank computing in fp32 keeps plain modules (trainer/sharding.py: the same numbers
    without FSDP2's per-unit hooks); `wrap_single_rank = True` (a subclass) wraps it anyway."""

    wrap_single_rank = False

    def __init__(
        self,
        cfg: TrainerConfig,
        model_spec: ModelSpec,
        rank: int,
        world: int,
        *,
        init_checkpoint: str = "",
        ref_checkpoint: str = "",
        seed: int = 0,
        weight_version: int = 0,
    ) -> None:
        check_world(cfg, world)
        if cfg.deterministic:  # before CUDA / NCCL initialise
            enable_deterministic(seed)
        # 'auto' of device, dtype, kernels and compile for the device this rank sees
        cfg = resolve_trainer(cfg, RuntimeFacts.probe(), moe=model_spec.is_moe)
        self.cfg, self.spec, self.rank, self.world = cfg, model_spec, rank, world
        self.device = pick_device(cfg.device, rank)
        ensure_process_group(rank, world, self.device)
        self.dtype = compute_dtype(cfg.param_dtype)
        mesh = make_mesh(self.device, world) if self.wrap_single_rank or wraps(world, self.dtype) else None
        policy = build_policy(model_spec, init_checkpoint, seed)
        # 'padded' rows never reach the model as a packed row (fillers excepted: they attend per sequence)
        policy.packed_attention = "varlen" if cfg.packed_attention == "padded" else cfg.packed_attention
        if cfg.compile != "off":
            if cfg.compile == "try":
                # a default must not end a run: where inductor cannot compile here (no Triton,
                # no compiler), dynamo logs the error and runs those pieces eagerly; `on` raises
                import torch._dynamo.config

                torch._dynamo.config.suppress_errors = True
            policy.compile_blocks()
        policy.set_recompute(cfg.recompute, cfg.recompute_layers)
        self.lora = cfg.lora.rank > 0
        if self.lora:  # adapters before sharding; only they are trainable
            apply_lora(policy, cfg.lora, seed)
        self.replay = cfg.routing_replay and model_spec.is_moe
        self.probe = RouterProbe(policy) if model_spec.is_moe else None
        shard(policy, [policy], mesh, self.device, self.dtype)
        parts: dict[str, nn.Module] = {"policy": policy}
        self.critic: ValueModel | None = None
        if cfg.advantage.estimator == "ppo":
            self.critic = ValueModel(model_spec, seed=seed + 1)
            self.critic.lm.set_recompute(cfg.recompute, cfg.recompute_layers)
            shard(self.critic, [self.critic.lm], mesh, self.device, self.dtype)
            parts["critic"] = self.critic
        # an unsharded container of the sharded roots, for one optimizer and one checkpoint
        self.trainable = nn.ModuleDict(parts)
        self.policy = policy
        self.ref: nn.Module | None = None
        if cfg.loss.kl_coef:
            ref = build_policy(model_spec, ref_checkpoint or init_checkpoint, seed)
            ref.requires_grad_(False)
            self.ref = shard(ref, [ref], mesh, self.device, self.dtype)
        self.teacher: nn.Module | None = None
        if cfg.distill.teacher_checkpoint:
            teacher = load_teacher(cfg.distill, model_spec)
            self.teacher = shard(teacher, [teacher], mesh, self.device, self.dtype)
        self.opt = build_optimizer(self.trainable.parameters(), cfg, self.device, rank)
        self.coll = Collectives(self.device)
        self.step = 0
        self.opt_steps = 0
        self.weight_version = weight_version
        self._rl = RLStep(self)
        self._offload = Offloader(
            lambda: [self.trainable] + [m for m in (self.ref, self.teacher) if m is not None],
            lambda: self.opt, self.device)
        self._flat_export = FlatExportBuffer()  # allocated at the first flat export (rank 0)
        self._shard_export = ShardExportBuffer()  # this rank's slices, at the first sharded export

    # ---------------------------------------------------------------- step
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL update on this rank's shard (trainer/rl_step.py); returns globally reduced metrics."""
        return self._rl.run(batch)

    def clip_and_step(self) -> float:
        """Clip the accumulated gradients, take one optimizer step; return the grad norm. A
        non-finite norm takes no step (trainer/nonfinite.py).
        (The megatron backend overrides it to reduce over its own process groups first.)"""
        cfg = self.cfg
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(list(self.trainable.parameters()), clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        value = float(norm)
        if skip_nonfinite(self.opt, value):
            return value
        set_lr(self.opt, lr_at(cfg.optim, self.opt_steps))
        self.opt.step()
        self.opt_steps += 1
        return value

    def nonfinite_weights(self) -> list[str]:
        """Names of this rank's policy weights holding a NaN or inf (none: publishable)."""
        self.ensure_loaded()
        return nonfinite_params(self.policy.named_parameters())

    def forward_model(
        self, model: nn.Module, mb: MicroBatch, *, temperature: float, replay: bool, with_entropy: bool
    ) -> ForwardOut:
        if self.cfg.true_on_policy:
            probe = self.probe if model is self.policy else None
            return invariant_forward(
                model, mb, temperature=temperature, replay=replay, with_entropy=with_entropy,
                probe=probe,
            )
        fwd = padded_forward if self.cfg.packed_attention == "padded" else packed_forward
        return fwd(model, mb, temperature=temperature, replay=replay, with_entropy=with_entropy)

    # ---------------------------------------------------------------- offload
    @property
    def offloaded(self) -> bool:
        return self._offload.offloaded

    def offload(self) -> float:
        """Move params, optimizer state and the reference model to host memory as one block
        (gradients are dropped); the next step or export reloads. Returns seconds spent."""
        return self._offload.offload([self.trainable])

    def reload(self) -> float:
        """Bring the offloaded state back to the device. Returns seconds spent."""
        return self._offload.reload()

    def ensure_loaded(self) -> None:
        self._offload.ensure_loaded()

    # ---------------------------------------------------------------- weights and state
    def export_hf_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every policy weight; a collective every rank must drain."""
        self.ensure_loaded()
        if self.lora:
            return iter_merged_hf_state(self.policy)
        return checkpoint.iter_hf_state(self.policy)

    def export_lora_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(layer name + '.lora_A' / '.lora_B', full tensor): the adapter-only sync payload."""
        if not self.lora:
            raise TrainerError("export_lora_state(): trainer.lora.rank is 0 (no adapters)")
        self.ensure_loaded()
        return iter_adapters(self.policy)

    def export_sync_state(self, flat: bool = False, dtype: torch.dtype | None = None
                          ) -> Iterable[tuple[str, torch.Tensor]] | FlatWeights:
        """What a weight sync pushes: with LoRA only the adapter payload (engines merge it onto
        their base, `engines/lora.py`), else every HF weight. A collective, like the others.

        `flat`: the full weights gathered into rank 0's persistent flat buffer (in `dtype`),
        sent as byte ranges (weightsync/flat.py); the other ranks drain the gather here
        and return nothing to push.
        """
        if not self.lora:
            if not flat:
                return self.export_hf_state()
            if self.rank != 0:
                for _ in self.export_hf_state():
                    pass
                return []
            if self.world == 1 and type(self).export_hf_state is FSDPTrainer.export_hf_state:
                # One rank holds every parameter whole: no gather, and the export is one
                # multi-tensor copy into the buffer (weightsync/flat_export.py).
                self.ensure_loaded()
                local = [(n, (p.to_local() if is_dtensor(p) else p).detach())
                         for n, p in self.policy.named_parameters()]
                return self._flat_export.fill_local(self.policy.spec, local, dtype)
            return self._flat_export.fill(self.export_hf_state(), dtype)
        self.ensure_loaded()
        return iter_adapter_payload(self.policy, self.cfg.lora)

    def export_sharded_state(self, dtype: torch.dtype | None = None) -> ShardExport:
        """This rank's own slices of every HF weight, cast to `dtype`, in the transfer plan's order
        (weightsync/flat_export.py): what a sharded sync (ShardedWeightSync) sends from every rank.

        Not a collective and no gather: no rank holds a tensor it does not own, and the extra
        memory is this rank's shard in `dtype`."""
        if self.lora:
            raise TrainerError("export_sharded_state(): LoRA syncs the adapter payload (export_sync_state), "
                               "not sharded full weights")
        self.ensure_loaded()
        params = [(n, (p.to_local() if is_dtensor(p) else p).detach(), tuple(p.shape))
                  for n, p in self.policy.named_parameters()]
        if self.world > 1 and not all(is_dtensor(p) for p in self.policy.parameters()):
            raise TrainerError("export_sharded_state(): every parameter must be an FSDP2 DTensor shard")
        return self._shard_export.fill(self.policy.spec, params, self.rank, self.world, dtype)

    def export_hf_checkpoint(self, path: str | Path) -> None:
        self.ensure_loaded()
        if self.lora:
            export_merged(path, self.policy)
            return
        checkpoint.export_hf(path, self.policy)

    def save_checkpoint(self, path: str | Path) -> None:
        save_rank(self, path)

    def load_checkpoint(self, path: str | Path) -> None:
        load_rank(self, path)

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
