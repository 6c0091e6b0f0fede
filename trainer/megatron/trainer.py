"""`MegatronTrainer`: one rank of the megatron-core backend, behind FSDPTrainer's contract.

The step itself (validation, mini-batches, packing, no-grad passes, advantages, the
shared `rl_loss` with its corrections, metrics) is `RLStep` (trainer/rl_step.py), which
this class holds as FSDPTrainer does: one implementation for both backends. This class is
its `StepBackend` for megatron: the model (a megatron GPTModel with tensor/expert
parallelism), the forward (padded rows, R3 in megatron's router), gradient reduction and
clipping over megatron's groups, and HF export (gathered from tensor- and expert-parallel
slices). Checkpoints and offload are trainer/rank_state.py's, as for FSDP.

`world` counts every rank; the batch given to `train_step` must be this rank's
data-parallel shard (`shard_batch(batch, trainer.dp_size)[trainer.dp_rank]`): ranks of
one tensor-parallel group take the same shard.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from miles.core.errors import TrainerError
from miles.core.schema.runtime import RuntimeFacts, resolve_trainer
from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.models.hf_io import hf_state_dict
from miles.trainer.batch import TrainBatch
from miles.trainer.config_checks import check_world
from miles.trainer.deterministic import enable_deterministic
from miles.trainer.dist import ensure_process_group, pick_device
from miles.trainer.forward import ForwardOut
from miles.trainer.megatron.available import require_megatron
from miles.trainer.megatron.build import build_gpt, check_parallel, init_parallel
from miles.trainer.megatron.forward import mcore_forward
from miles.trainer.megatron.grads import GroupCollectives, reduce_and_clip
from miles.trainer.megatron.layout import targets
from miles.trainer.megatron.replay import MegatronRouting
from miles.trainer.megatron.weights import iter_hf, load_hf
from miles.trainer.nonfinite import nonfinite_params, skip_nonfinite
from miles.trainer.optim import lr_at, set_lr
from miles.trainer.optim_stream import build_optimizer
from miles.trainer.packing import MicroBatch
from miles.trainer.rank_state import Offloader, load_rank, save_rank
from miles.trainer.rl_step import RLStep
from miles.trainer.sharding import build_policy, compute_dtype
from miles.weightsync.flat import FlatWeights
from miles.weightsync.flat_export import FlatExportBuffer
from miles.weightsync.megatron_export import MegatronShards
from miles.weightsync.shard_megatron import MegatronParallel
from miles.weightsync.shard_plan import ShardExport


class MegatronTrainer:
    """One megatron-core rank. Same constructor and methods as `FSDPTrainer`."""

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
        _, _, dp = check_parallel(cfg.megatron, model_spec, world)
        require_megatron()
        from megatron.core import parallel_state as ps

        if cfg.deterministic:
            enable_deterministic(seed)
        cfg = resolve_trainer(cfg, RuntimeFacts.probe(), moe=model_spec.is_moe)  # auto: for this rank's device
        self.cfg, self.spec, self.rank = cfg, model_spec, rank
        self.device = pick_device(cfg.device, rank)
        ensure_process_group(rank, world, self.device)
        init_parallel(cfg.megatron, seed)
        self.global_world = world
        # the loss scale and metric reductions are over data-parallel ranks (see grads.py)
        self.world = self.dp_size = dp
        self.dp_rank = ps.get_data_parallel_rank()
        self.dtype = compute_dtype(cfg.param_dtype)
        self.policy = self._build(init_checkpoint, seed)
        self.lora = False
        self.critic = None
        self.teacher = None
        self.replay = cfg.routing_replay and model_spec.is_moe
        self.routing = MegatronRouting(self.policy) if model_spec.is_moe else None
        self.probe = self.routing
        self.trainable = nn.ModuleDict({"policy": self.policy})
        self.ref: nn.Module | None = None
        self.ref_routing: MegatronRouting | None = None
        if cfg.loss.kl_coef:
            self.ref = self._build(ref_checkpoint or init_checkpoint, seed)
            self.ref.requires_grad_(False)
            self.ref_routing = MegatronRouting(self.ref) if model_spec.is_moe else None
        self.opt = build_optimizer(self.trainable.parameters(), cfg, self.device, rank)
        self.coll = GroupCollectives(self.device, ps.get_data_parallel_group(), dp)
        self.step = 0
        self.opt_steps = 0
        self.weight_version = weight_version
        self._rl = RLStep(self)
        self._offload = Offloader(
            lambda: [self.trainable] + [m for m in (self.ref, self.teacher) if m is not None],
            lambda: self.opt, self.device)
        self._flat_export = FlatExportBuffer()
        self._shards: MegatronShards | None = None  # the sharded export, built at its first use

    def _build(self, checkpoint: str, seed: int) -> nn.Module:
        """GPTModel with the weights FSDP2 would start from (checkpoint, or seeded init)."""
        model = build_gpt(self.spec, self.cfg.megatron)
        load_hf(model, self.spec, hf_state_dict(build_policy(self.spec, checkpoint, seed)))
        return model

    # ---------------------------------------------------------------- the step
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL update on this rank's data-parallel shard (trainer/rl_step.py)."""
        return self._rl.run(batch)

    def forward_model(
        self, model: nn.Module, mb: MicroBatch, *, temperature: float, replay: bool, with_entropy: bool
    ) -> ForwardOut:
        routing = self.routing if model is self.policy else self.ref_routing
        return mcore_forward(
            model, mb, temperature=temperature, replay=replay, with_entropy=with_entropy,
            dtype=self.dtype, routing=routing,
        )

    def clip_and_step(self) -> float:
        norm = reduce_and_clip(list(self.trainable.parameters()), self.dp_size, self.cfg.optim.grad_clip)
        if skip_nonfinite(self.opt, norm):  # no update from a NaN/inf gradient (trainer/nonfinite.py)
            return norm
        set_lr(self.opt, lr_at(self.cfg.optim, self.opt_steps))
        self.opt.step()
        self.opt_steps += 1
        return norm

    def forward_micro_batch(self, mb: MicroBatch, *, replay: bool | None = None) -> ForwardOut:
        """No-grad policy forward of one micro-batch (validation and benchmarks); afterwards
        `self.routing.used` holds the expert ids each MoE layer used, [N, L, k]."""
        self.ensure_loaded()
        use = self.replay if replay is None else replay
        with torch.no_grad():
            return mcore_forward(
                self.policy, mb.to(self.device), temperature=mb.temperature, replay=use,
                with_entropy=False, dtype=self.dtype, routing=self.routing, keep_routes=True,
            )

    def nonfinite_weights(self) -> list[str]:
        """Names of this rank's policy weights holding a NaN or inf (none: publishable)."""
        self.ensure_loaded()
        return nonfinite_params(self.policy.named_parameters())

    # ---------------------------------------------------------------- weights and state
    def export_hf_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full fp32 tensor) of every policy weight; a collective every rank must drain."""
        self.ensure_loaded()
        return iter_hf(self.policy, self.spec)

    def export_lora_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise TrainerError("export_lora_state(): the megatron backend has no LoRA adapters")

    def export_sync_state(self, flat: bool = False, dtype: torch.dtype | None = None
                          ) -> Iterable[tuple[str, torch.Tensor]] | FlatWeights:
        """What a weight sync pushes: every HF weight (a collective); `flat`: gathered into rank
        0's persistent flat buffer in `dtype` (the other ranks drain the gather, push nothing)."""
        if not flat:
            return self.export_hf_state()
        if self.rank != 0:
            for _ in self.export_hf_state():
                pass
            return []
        return self._flat_export.fill(self.export_hf_state(), dtype)

    def export_sharded_state(self, dtype: torch.dtype | None = None) -> ShardExport:
        """This rank's own tensor-/expert-parallel slices of every HF weight, cast to `dtype` (None:
        the parameters' dtype), by the Megatron transfer plan: what a sharded sync sends from
        every rank (weightsync/megatron_export.py). Not a collective, no gather."""
        self.ensure_loaded()
        params = dict(self.policy.named_parameters())
        if self._shards is None:
            from megatron.core import parallel_state as ps

            tp, ep, dp = check_parallel(self.cfg.megatron, self.spec, self.global_world)
            self._shards = MegatronShards(self.spec, params.keys(), MegatronParallel(tp=tp, ep=ep, dp=dp),
                                          self.rank, ps.get_expert_model_parallel_rank(), targets)
        wire = dtype if dtype is not None else next(iter(params.values())).dtype
        return self._shards.export(params, str(wire).removeprefix("torch."))

    def export_hf_checkpoint(self, path: str | Path) -> None:
        """config.json + model.safetensors (fp32) from rank 0; every rank must call."""
        self.ensure_loaded()
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in self.export_hf_state()}
        if dist.get_rank() == 0:
            d = Path(path)
            d.mkdir(parents=True, exist_ok=True)
            hf_cfg = dict(self.spec.hf_config)
            hf_cfg["torch_dtype"] = "float32"
            (d / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True))
            save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        dist.barrier()

    # ---------------------------------------------------------------- offload and checkpoints
    @property
    def offloaded(self) -> bool:
        return self._offload.offloaded

    def offload(self) -> float:
        return self._offload.offload([self.trainable])

    def reload(self) -> float:
        return self._offload.reload()

    def ensure_loaded(self) -> None:
        self._offload.ensure_loaded()

    def save_checkpoint(self, path: str | Path) -> None:
        save_rank(self, path)

    def load_checkpoint(self, path: str | Path) -> None:
        load_rank(self, path)

    def close(self) -> None:
        for r in (self.routing, self.ref_routing):
            if r is not None:
                r.close()
