"""`FSDPTrainer`: one data-parallel rank of the FSDP2 backend, as a plain class.

The actor shell wraps it: construct once per rank, call `train_step(shard)` with this
rank's shard of the global batch (whole groups; see `batch.shard_batch`), read the
returned metrics, and stream `export_hf_state()` into weight sync. Every rank must make
the same calls in the same order (they are collectives).

A step: validate -> split into mini-batches -> pack micro-batches by token budget (padded
with filler micro-batches so every rank runs as many) -> no-grad passes for old-policy,
reference and value estimates -> advantages -> per mini-batch: forward/backward over its
micro-batches with gradient accumulation, clip, AdamW step at the scheduled LR.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from miles.core.errors import TrainerError
from miles.core.logging import get_logger
from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.trainer import checkpoint
from miles.trainer.advantages import (
    discounted_returns,
    gae,
    group_advantages,
    token_rewards,
    whiten,
)
from miles.trainer.aggregation import Denominators, local_denominators
from miles.trainer.batch import TrainBatch, TrainSample, split_mini_batches, validate_batch
from miles.trainer.config_checks import check_trainer_config, compile_enabled
from miles.trainer.corrections import finish_ess, needs_rollout_logprobs
from miles.trainer.deterministic import enable_deterministic
from miles.trainer.dist import Collectives, ensure_process_group, pick_device
from miles.trainer.distill import distill_advantages, load_teacher
from miles.trainer.flat_export import FlatExportBuffer, ShardExportBuffer
from miles.trainer.forward import ForwardOut, RouterProbe, packed_forward, padded_forward
from miles.trainer.kl import kl_estimate
from miles.trainer.lora import (
    apply_lora,
    export_merged,
    iter_adapter_payload,
    iter_adapters,
    iter_merged_hf_state,
)
from miles.trainer.metrics import StepMetrics
from miles.trainer.offload import FlatOffload, trainer_state_tensors
from miles.trainer.optim import lr_at, set_lr
from miles.trainer.optim_stream import build_optimizer
from miles.trainer.packing import MicroBatch, filler_micro_batch, pack, plan_micro_batches
from miles.trainer.rl_loss import LossInputs, rl_loss
from miles.trainer.sharding import build_policy, compute_dtype, is_dtensor, make_mesh, shard, wraps
from miles.trainer.true_on_policy import invariant_forward
from miles.trainer.value import ValueModel
from miles.transport.bulk.flat import FlatWeights
from miles.transport.bulk.shard_plan import ShardExport

log = get_logger("trainer.fsdp")
_SUM_KEYS = ("train/loss", "train/pg_loss", "train/kl_loss", "train/value_loss")


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
        asynchronous: bool = True,
        weight_version: int = 0,
    ) -> None:
        check_trainer_config(cfg, asynchronous, world)
        self.cfg, self.spec, self.rank, self.world = cfg, model_spec, rank, world
        if cfg.deterministic:  # before CUDA / NCCL initialise
            enable_deterministic(seed)
        self.device = pick_device(cfg.device, rank)
        ensure_process_group(rank, world, self.device)
        self.dtype = compute_dtype(cfg.param_dtype, self.device)
        mesh = make_mesh(self.device, world) if self.wrap_single_rank or wraps(world, self.dtype) else None
        policy = build_policy(model_spec, init_checkpoint, seed)
        # 'padded' rows never reach the model as a packed row (fillers excepted: they attend per sequence)
        policy.packed_attention = "varlen" if cfg.packed_attention == "padded" else cfg.packed_attention
        if compile_enabled(cfg, self.device.type, model_spec.is_moe):
            if cfg.compile == "auto":
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
        self._rollout_lp = False
        self._offload: FlatOffload | None = None
        self._flat_export = FlatExportBuffer()  # allocated at the first flat export (rank 0)
        self._shard_export = ShardExportBuffer()  # this rank's slices, at the first sharded export
        self._old_is_current = False  # set per step by `_single_update`

    # ---------------------------------------------------------------- step
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL update on this rank's shard; returns globally reduced metrics."""
        cfg = self.cfg
        t0 = time.perf_counter()
        self._ensure_loaded()
        validate_batch(
            batch,
            needs_rollout_logprobs=needs_rollout_logprobs(cfg.correction),
            moe_layers=self.spec.num_moe_layers,
            topk=self.spec.num_experts_per_tok,
            num_experts=self.spec.num_experts,
            replay=self.replay,
        )
        samples = batch.samples
        self._rollout_lp = all(s.rollout_logprobs is not None for s in samples)
        index = {id(s): i for i, s in enumerate(samples)}
        minis = [[index[id(s)] for s in m] for m in split_mini_batches(samples, cfg.mini_batches)]
        per_token = {
            "rollout_logp": [
                s.rollout_logprobs
                if s.rollout_logprobs is not None
                else np.zeros(s.response_ids.size, np.float32)
                for s in samples
            ]
        }
        plans = [self._pack_mini(samples, idx, per_token) for idx in minis]
        counts = self.coll.max(torch.tensor([len(p) for p in plans], dtype=torch.float64))
        for p, want in zip(plans, counts.tolist(), strict=True):
            p.extend(filler_micro_batch(list(per_token)) for _ in range(int(want) - len(p)))
        metrics = StepMetrics()
        self._old_is_current = self._single_update(len(plans))
        self._no_grad_passes([mb for p in plans for mb in p], metrics)
        self._advantages(samples, plans, metrics)
        grad_norms = []
        for plan in plans:
            grad_norms.append(self._optimize(plan, metrics))
        out = metrics.reduce(self.coll.sum, self.coll.max)
        finish_ess(out)
        for k in _SUM_KEYS:
            if k in out:
                out[k] /= len(plans)
        dt = time.perf_counter() - t0
        tokens = float(
            self.coll.sum(torch.tensor([float(batch.num_tokens)], dtype=torch.float64))[0]
        )
        self.step += 1
        self.weight_version += 1
        out.update(
            {
                "train/grad_norm": float(np.mean(grad_norms)),
                "train/lr": lr_at(cfg.optim, self.opt_steps - 1),
                "train/step_time_s": dt,
                "train/tokens": tokens,
                "train/tokens_per_s": tokens / dt if dt > 0 else 0.0,
                "train/step": float(self.step),
                "train/weight_version": float(self.weight_version),
            }
        )
        return out

    def _pack_mini(
        self, samples: list[TrainSample], idx: list[int], per_token: dict[str, list[np.ndarray]]
    ) -> list[MicroBatch]:
        bins = plan_micro_batches([samples[i].total_len for i in idx], self.cfg.micro_batch_tokens)
        # routes are packed whenever recorded, so live-vs-recorded overlap is measured even
        # when replay is off; packed_forward passes them to the model only with replay on
        routes = self.spec.is_moe and all(s.routed_experts is not None for s in samples)
        return [pack(samples, [idx[b] for b in bin_], per_token, replay=routes) for bin_ in bins]

    def _single_update(self, num_updates: int) -> bool:
        """Whether the old-policy logprobs are the current ones, so the no-grad pass can go.

        With one optimizer step per batch, every micro-batch's forward runs at the step's start
        weights: its logprobs, detached, are exactly what the recompute pass would give (ratio 1).
        The pass stays where the algorithm reads old logprobs before or across updates: several
        mini-batches, a KL term folded into the reward, distillation advantages.
        """
        cfg = self.cfg
        return (
            cfg.correction.old_logprobs == "recompute"
            and cfg.correction.old_logprobs_pass == "auto"
            and num_updates == 1
            and not (self.ref is not None and cfg.loss.kl_in_reward)
            and self.teacher is None
        )

    @torch.no_grad()
    def _no_grad_passes(self, mbs: list[MicroBatch], metrics: StepMetrics) -> None:
        cfg = self.cfg
        recompute = cfg.correction.old_logprobs == "recompute" and not self._old_is_current
        # (fused: the routing overlap is measured in the training forward instead)
        probe_here = self.probe is not None and not self._old_is_current
        for cpu_mb in mbs:
            mb = cpu_mb.to(self.device)
            real = mb.num_seqs > 0
            if recompute or (probe_here and real):
                if self.probe is not None:
                    self.probe.reset()
                    self.probe.active = real
                fo = self._forward(
                    self.policy,
                    mb,
                    temperature=cfg.temperature,
                    replay=self.replay,
                    with_entropy=False,
                )
                if self.probe is not None:
                    self.probe.active = False
                    if real and mb.routed_experts is not None:
                        self.probe.select(fo.token_index)
                        tot, cnt = self.probe.overlap(
                            mb.routed_experts, self.spec.num_experts_per_tok, mb.route_valid
                        )
                        metrics.add_mean("train/routing_overlap", tot, cnt)
                    self.probe.reset()
                cpu_mb.fields["old_logp"] = fo.logp.float().cpu()
            if self.ref is not None:
                cpu_mb.fields["ref_logp"] = (
                    self._forward(
                        self.ref,
                        mb,
                        temperature=cfg.temperature,
                        replay=self.replay,
                        with_entropy=False,
                    )
                    .logp.float()
                    .cpu()
                )
            if self.teacher is not None:
                cpu_mb.fields["teacher_logp"] = (
                    self._forward(
                        self.teacher,
                        mb,
                        temperature=cfg.temperature,
                        replay=False,  # another model: the student's routes do not apply
                        with_entropy=False,
                    )
                    .logp.float()
                    .cpu()
                )
            if self.critic is not None:
                routes = mb.routed_experts.unsqueeze(0) if mb.routed_experts is not None else None
                cpu_mb.fields["old_values"] = self.critic(mb, routes).cpu()

    def _advantages(
        self, samples: list[TrainSample], plans: list[list[MicroBatch]], metrics: StepMetrics
    ) -> None:
        """Fill `fields['adv']` (and `returns` for ppo) of every micro-batch."""
        cfg, ac = self.cfg, self.cfg.advantage
        mbs = [mb for p in plans for mb in p if mb.num_seqs]
        tok: dict[str, dict[int, torch.Tensor]] = {}
        for mb in mbs:
            # the response view holds each sequence's tokens contiguously, in packing order
            counts = [samples[sid].response_ids.size for sid in mb.sample_ids]
            for name, t in mb.fields.items():
                tok.setdefault(name, {}).update(zip(mb.sample_ids, t.split(counts), strict=True))
        n = len(samples)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        masks = [torch.from_numpy(s.loss_mask) for s in samples]  # type: ignore[arg-type]
        metrics.add_mean("train/reward", float(rewards.sum()), n)
        old = tok.get("old_logp", tok["rollout_logp"])
        if cfg.correction.old_logprobs == "rollout":
            old = tok["rollout_logp"]
        kl = None
        if "ref_logp" in tok and cfg.loss.kl_in_reward:
            kl = [kl_estimate(old[i], tok["ref_logp"][i], cfg.loss.kl_estimator) for i in range(n)]
        advs: list[torch.Tensor]
        rets: list[torch.Tensor] | None = None
        if ac.estimator in ("grpo", "gspo", "cispo"):
            groups = torch.tensor([s.group_index for s in samples], dtype=torch.long)
            a = group_advantages(rewards, groups, std_normalize=ac.std_normalize, eps=ac.eps)
            advs = [torch.full((s.response_ids.size,), float(a[i])) for i, s in enumerate(samples)]
        elif ac.estimator == "reinforce_pp":
            tr = token_rewards(rewards.tolist(), masks, kl, cfg.loss.kl_coef)
            advs = discounted_returns(tr, ac.gamma)
            if ac.whiten:
                advs = whiten(advs, masks, self.coll.sum)
        else:
            tr = token_rewards(rewards.tolist(), masks, kl, cfg.loss.kl_coef)
            values = [tok["old_values"][i] for i in range(n)]
            advs, rets = gae(tr, values, ac.gamma, ac.lam)
            if ac.whiten:
                advs = whiten(advs, masks, self.coll.sum)
        if "teacher_logp" in tok:
            advs, kls = distill_advantages(
                [old[i] for i in range(n)],
                [tok["teacher_logp"][i] for i in range(n)],
                advs,
                cfg.distill,
            )
            for i in range(n):
                m = masks[i] > 0
                metrics.add_mean("train/distill_reverse_kl", float(kls[i][m].sum()), float(m.sum()))
        for mb in mbs:
            mb.fields["adv"] = torch.cat([advs[i] for i in mb.sample_ids]).float()
            if rets is not None:
                mb.fields["returns"] = torch.cat([rets[i] for i in mb.sample_ids]).float()
            if self.cfg.correction.old_logprobs == "rollout":
                mb.fields["old_logp"] = mb.fields["rollout_logp"]
        for p in plans:
            for mb in p:
                if not mb.num_seqs:
                    for name in ("adv", "returns", "old_logp", "ref_logp", "old_values", "teacher_logp"):
                        mb.fields.setdefault(name, torch.zeros(0))
        for i, s in enumerate(samples):
            m = masks[i] > 0
            metrics.add_mean("train/advantage", float(advs[i][m].sum()), float(m.sum()))
            if s.versions is not None:
                # Only tokens the policy sampled: tokens spliced in between turns (tool output, the
                # next user message) carry version -1 and are not stale, whatever the step.
                sampled = s.versions[s.versions >= 0].astype(np.float64)
                stale = self.weight_version - sampled
                metrics.add_mean("train/staleness", float(stale.sum()), float(stale.size))

    def _optimize(self, plan: list[MicroBatch], metrics: StepMetrics) -> float:
        cfg = self.cfg
        local = torch.zeros(2, dtype=torch.float64)
        for mb in plan:
            local += local_denominators(mb.loss_mask, mb.resp_seq, mb.num_seqs)
        tot = self.coll.sum(local)
        denom = Denominators(tokens=float(tot[0]), seqs=float(tot[1]))
        self.opt.zero_grad(set_to_none=True)
        for cpu_mb in plan:
            mb = cpu_mb.to(self.device)
            probe = self.probe if self._old_is_current and mb.num_seqs else None
            if probe is not None:
                probe.reset()
                probe.active = True
            fo = self._forward(
                self.policy, mb, temperature=cfg.temperature, replay=self.replay, with_entropy=True
            )
            if probe is not None:
                probe.active = False
                if mb.routed_experts is not None:
                    probe.select(fo.token_index)
                    tot, cnt = probe.overlap(
                        mb.routed_experts, self.spec.num_experts_per_tok, mb.route_valid
                    )
                    metrics.add_mean("train/routing_overlap", tot, cnt)
                probe.reset()
            if self._old_is_current and mb.num_seqs:
                mb.fields["old_logp"] = fo.logp.detach()  # the recompute pass's value, exactly
            if not mb.num_seqs:
                loss = fo.logits.sum() * 0.0
                if self.critic is not None:
                    loss = loss + self.critic(mb).sum() * 0.0
                (loss * self.world).backward()
                continue
            f = mb.fields
            values = None
            if self.critic is not None:
                routes = mb.routed_experts.unsqueeze(0) if mb.routed_experts is not None else None
                values = self.critic(mb, routes)
            x = LossInputs(
                logp=fo.logp,
                old_logp=f.get("old_logp"),
                rollout_logp=f["rollout_logp"] if self._rollout_lp else None,
                adv=f["adv"],
                mask=mb.loss_mask,
                seq=mb.resp_seq,
                num_seqs=mb.num_seqs,
                ref_logp=f.get("ref_logp"),
                entropy=fo.entropy,
                values=values,
                old_values=f.get("old_values"),
                returns=f.get("returns"),
            )
            loss = rl_loss(cfg, x, denom, metrics)
            # FSDP averages gradients over ranks; each rank's loss is its share of the global
            # loss, so scaling by world makes the reduced gradient that of the global loss.
            (loss * self.world).backward()
        return self._clip_and_step()

    def _clip_and_step(self) -> float:
        """Clip the accumulated gradients, take one optimizer step; return the grad norm.
        (The megatron backend overrides it to reduce over its own process groups first.)"""
        cfg = self.cfg
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(list(self.trainable.parameters()), clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        set_lr(self.opt, lr_at(cfg.optim, self.opt_steps))
        self.opt.step()
        self.opt_steps += 1
        return float(norm)

    def _forward(
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
        return self._offload is not None and self._offload.offloaded

    def offload(self) -> float:
        """Move params, optimizer state and the reference model to host memory as one block
        (gradients are dropped); the next step or export reloads. Returns seconds spent."""
        if self._offload is None:
            mods = [self.trainable] + [m for m in (self.ref, self.teacher) if m is not None]
            self._offload = FlatOffload(
                lambda: trainer_state_tensors(mods, [self.opt]), self.device
            )
        return self._offload.offload([self.trainable])

    def reload(self) -> float:
        """Bring the offloaded state back to the device. Returns seconds spent."""
        if self._offload is None:
            raise TrainerError("reload() before any offload()")
        return self._offload.reload()

    def _ensure_loaded(self) -> None:
        if self.offloaded:
            self.reload()

    # ---------------------------------------------------------------- weights and state
    def export_hf_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every policy weight; a collective every rank must drain."""
        self._ensure_loaded()
        if self.lora:
            return iter_merged_hf_state(self.policy)
        return checkpoint.iter_hf_state(self.policy)

    def export_lora_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(layer name + '.lora_A' / '.lora_B', full tensor): the adapter-only sync payload."""
        if not self.lora:
            raise TrainerError("export_lora_state(): trainer.lora.rank is 0 (no adapters)")
        self._ensure_loaded()
        return iter_adapters(self.policy)

    def export_sync_state(self, flat: bool = False, dtype: torch.dtype | None = None
                          ) -> Iterable[tuple[str, torch.Tensor]] | FlatWeights:
        """What a weight sync pushes: with LoRA only the adapter payload (engines merge it onto
        their base, `engines/lora.py`), else every HF weight. A collective, like the others.

        `flat`: the full weights gathered into rank 0's persistent flat buffer (in `dtype`),
        sent as byte ranges (transport/bulk/flat.py); the other ranks drain the gather here
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
                # multi-tensor copy into the buffer (trainer/flat_export.py).
                self._ensure_loaded()
                local = [(n, (p.to_local() if is_dtensor(p) else p).detach())
                         for n, p in self.policy.named_parameters()]
                return self._flat_export.fill_local(self.policy.spec, local, dtype)
            return self._flat_export.fill(self.export_hf_state(), dtype)
        self._ensure_loaded()
        return iter_adapter_payload(self.policy, self.cfg.lora)

    def export_sharded_state(self, dtype: torch.dtype | None = None) -> ShardExport:
        """This rank's own slices of every HF weight, cast to `dtype`, in the transfer plan's order
        (trainer/flat_export.py): what a sharded sync (ShardedWeightSync) sends from every rank.

        Not a collective and no gather: no rank holds a tensor it does not own, and the extra
        memory is this rank's shard in `dtype`."""
        if self.lora:
            raise TrainerError("export_sharded_state(): LoRA syncs the adapter payload (export_sync_state), "
                               "not sharded full weights")
        self._ensure_loaded()
        params = [(n, (p.to_local() if is_dtensor(p) else p).detach(), tuple(p.shape))
                  for n, p in self.policy.named_parameters()]
        if self.world > 1 and not all(is_dtensor(p) for p in self.policy.parameters()):
            raise TrainerError("export_sharded_state(): every parameter must be an FSDP2 DTensor shard")
        return self._shard_export.fill(self.policy.spec, params, self.rank, self.world, dtype)

    def export_hf_checkpoint(self, path: str | Path) -> None:
        self._ensure_loaded()
        if self.lora:
            export_merged(path, self.policy)
            return
        checkpoint.export_hf(path, self.policy)

    def save_checkpoint(self, path: str | Path) -> None:
        self._ensure_loaded()
        meta = {
            "step": self.step,
            "opt_steps": self.opt_steps,
            "weight_version": self.weight_version,
            "world": self.world,
        }
        checkpoint.save(path, self.trainable, self.opt, meta)

    def load_checkpoint(self, path: str | Path) -> None:
        self._ensure_loaded()
        meta = checkpoint.load(path, self.trainable, self.opt)
        if meta.get("world") != self.world:
            log.warning("checkpoint_world_changed", saved=meta.get("world"), now=self.world)
        self.step = int(meta["step"])
        self.opt_steps = int(meta["opt_steps"])
        self.weight_version = int(meta["weight_version"])

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
