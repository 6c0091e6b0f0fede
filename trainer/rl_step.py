"""The RL step both trainer backends run (FSDP2 and megatron-core), as a plain class.

A step: validate -> split into mini-batches -> pack micro-batches by token budget (padded
with filler micro-batches so every rank runs as many) -> no-grad passes for old-policy,
reference and value estimates -> advantages -> per mini-batch: forward/backward over its
micro-batches with gradient accumulation, then the backend's clip and optimizer step.

What differs between backends is behind `StepBackend`: the models, the forward, the
collectives and the clip-and-step. A backend holds an `RLStep` and calls `run(batch)`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Protocol

import numpy as np
import torch
from torch import nn

from miles.core.logging import get_logger
from miles.core.schema.trainer import TrainerConfig
from miles.models.config import ModelSpec
from miles.trainer.advantages import (
    discounted_returns,
    gae,
    group_advantages,
    token_rewards,
    whiten,
)
from miles.trainer.aggregation import Denominators, local_denominators
from miles.trainer.batch import TrainBatch, TrainSample, split_mini_batches, validate_batch
from miles.trainer.corrections import finish_ess, needs_rollout_logprobs
from miles.trainer.dist import Collectives
from miles.trainer.distill import distill_advantages
from miles.trainer.forward import ForwardOut, RouterProbe
from miles.trainer.kl import kl_estimate
from miles.trainer.metrics import StepMetrics
from miles.trainer.nonfinite import diagnose, find_culprit
from miles.trainer.optim import lr_at
from miles.trainer.packing import MicroBatch, filler_micro_batch, pack, plan_micro_batches
from miles.trainer.rl_loss import LossInputs, rl_loss
from miles.trainer.value import ValueModel

log = get_logger("trainer.step")

_SUM_KEYS = ("train/loss", "train/pg_loss", "train/kl_loss", "train/value_loss")


class StepBackend(Protocol):
    """What the RL step needs of a trainer backend (FSDPTrainer, MegatronTrainer)."""

    cfg: TrainerConfig
    spec: ModelSpec
    device: torch.device
    world: int  # the ranks the loss is shared over (data-parallel ranks)
    replay: bool
    # read-only (properties): a backend may hold narrower types (GroupCollectives, CausalLM, None)

    @property
    def coll(self) -> Collectives: ...  # sum / max over those ranks
    @property
    def policy(self) -> nn.Module: ...
    @property
    def ref(self) -> nn.Module | None: ...
    @property
    def teacher(self) -> nn.Module | None: ...
    @property
    def critic(self) -> ValueModel | None: ...
    @property
    def probe(self) -> RouterProbe | None: ...  # MoE: the live routing, to measure its overlap with the engine's
    opt: torch.optim.Optimizer
    step: int
    opt_steps: int
    weight_version: int

    def ensure_loaded(self) -> None:
        """Bring offloaded state back before computing."""

    def forward_model(self, model: nn.Module, mb: MicroBatch, *, temperature: float, replay: bool,
                      with_entropy: bool) -> ForwardOut: ...

    def clip_and_step(self) -> float:
        """Clip the accumulated gradients and take one optimizer step (opt_steps += 1); return the
        global grad norm. A non-finite norm takes no step and drops the gradients
        (`nonfinite.skip_nonfinite`)."""
        ...


class RLStep:
    """The backend-neutral RL update over a `StepBackend`."""

    def __init__(self, backend: StepBackend) -> None:
        self.b = backend
        self.rollout_lp = False  # every sample of this step carries the engine's logprobs
        self.old_is_current = False  # set per step by `_single_update`
        self.skipped = 0  # updates skipped for a non-finite gradient, over the run
        self.last_culprit: dict[str, object] = {}  # what the last skipped step's culprit held (logged too)

    def run(self, batch: TrainBatch) -> dict[str, float]:
        """One RL update on this rank's shard; returns globally reduced metrics."""
        b = self.b
        cfg = b.cfg
        t0 = time.perf_counter()
        b.ensure_loaded()
        validate_batch(
            batch,
            needs_rollout_logprobs=needs_rollout_logprobs(cfg.correction),
            moe_layers=b.spec.num_moe_layers,
            topk=b.spec.num_experts_per_tok,
            num_experts=b.spec.num_experts,
            replay=b.replay,
        )
        samples = batch.samples
        self.rollout_lp = all(s.rollout_logprobs is not None for s in samples)
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
        counts = b.coll.max(torch.tensor([len(p) for p in plans], dtype=torch.float64))
        for p, want in zip(plans, counts.tolist(), strict=True):
            p.extend(filler_micro_batch(list(per_token)) for _ in range(int(want) - len(p)))
        metrics = StepMetrics()
        self.old_is_current = self._single_update(len(plans))
        self._no_grad_passes([mb for p in plans for mb in p], metrics)
        self._advantages(samples, plans, metrics)
        skipped = self.skipped
        grad_norms = [self._optimize(plan, metrics) for plan in plans]
        applied = [g for g in grad_norms if math.isfinite(g)]
        out = metrics.reduce(b.coll.sum, b.coll.max)
        finish_ess(out)
        for k in _SUM_KEYS:
            if k in out:
                out[k] /= len(plans)
        dt = time.perf_counter() - t0
        tokens = float(
            b.coll.sum(torch.tensor([float(batch.num_tokens)], dtype=torch.float64))[0]
        )
        b.step += 1
        b.weight_version += 1
        out.update(
            {
                # of the applied updates; NaN (None in metrics.jsonl) when none was
                "train/grad_norm": float(np.mean(applied)) if applied else float("nan"),
                "train/skipped_nonfinite": float(self.skipped - skipped),
                "train/skipped_nonfinite_total": float(self.skipped),
                "train/lr": lr_at(cfg.optim, b.opt_steps - 1),
                "train/step_time_s": dt,
                "train/tokens": tokens,
                "train/tokens_per_s": tokens / dt if dt > 0 else 0.0,
                "train/step": float(b.step),
                "train/weight_version": float(b.weight_version),
            }
        )
        if b.device.type == "cuda":  # what one trainer needs of a shared card (issue 44's memory goal)
            out["perf/trainer_peak_gb"] = torch.cuda.max_memory_allocated(b.device) / 1e9
        return out

    def _pack_mini(
        self, samples: list[TrainSample], idx: list[int], per_token: dict[str, list[np.ndarray]]
    ) -> list[MicroBatch]:
        # routes are packed whenever recorded, so live-vs-recorded overlap is measured even
        # when replay is off; packed_forward passes them to the model only with replay on
        routes = self.b.spec.is_moe and all(s.routed_experts is not None for s in samples)
        # A micro-batch's forward takes logprobs under one temperature: samples drawn at different
        # ones (per-prompt or per-request sampling) are packed apart, in first-seen order.
        by_temp: dict[float, list[int]] = {}
        for i in idx:
            by_temp.setdefault(samples[i].logprob_temperature, []).append(i)
        out: list[MicroBatch] = []
        for run in by_temp.values():
            bins = plan_micro_batches([samples[i].total_len for i in run], self.b.cfg.micro_batch_tokens)
            out += [pack(samples, [run[b] for b in bin_], per_token, replay=routes) for bin_ in bins]
        return out

    def _single_update(self, num_updates: int) -> bool:
        """Whether the old-policy logprobs are the current ones, so the no-grad pass can go.

        With one optimizer step per batch, every micro-batch's forward runs at the step's start
        weights: its logprobs, detached, are exactly what the recompute pass would give (ratio 1).
        The pass stays where the algorithm reads old logprobs before or across updates: several
        mini-batches, a KL term folded into the reward, distillation advantages.
        """
        cfg = self.b.cfg
        return (
            cfg.correction.old_logprobs == "recompute"
            and cfg.correction.old_logprobs_pass == "when_needed"
            and num_updates == 1
            and not (self.b.ref is not None and cfg.loss.kl_in_reward)
            and self.b.teacher is None
        )

    def _policy_forward(self, mb: MicroBatch, metrics: StepMetrics, *, probe: bool,
                        with_entropy: bool) -> ForwardOut:
        """The policy's forward of `mb`; with `probe` (and a MoE policy) the router probe records
        the live routing, and its overlap with the engine's goes into `train/routing_overlap`."""
        b = self.b
        live = b.probe if probe else None
        if live is not None:
            live.reset()
            live.active = True
        fo = b.forward_model(b.policy, mb, temperature=mb.temperature, replay=b.replay,
                             with_entropy=with_entropy)
        if live is not None:
            live.active = False
            if mb.routed_experts is not None:
                live.select(fo.token_index)
                tot, cnt = live.overlap(mb.routed_experts, b.spec.num_experts_per_tok, mb.route_valid)
                metrics.add_mean("train/routing_overlap", tot, cnt)
            live.reset()
        return fo

    @torch.no_grad()
    def _no_grad_passes(self, mbs: list[MicroBatch], metrics: StepMetrics) -> None:
        b = self.b
        cfg = b.cfg
        recompute = cfg.correction.old_logprobs == "recompute" and not self.old_is_current
        # (fused: the routing overlap is measured in the training forward instead)
        probe_here = b.probe is not None and not self.old_is_current
        for cpu_mb in mbs:
            mb = cpu_mb.to(b.device)
            real = mb.num_seqs > 0
            if recompute or (probe_here and real):
                fo = self._policy_forward(mb, metrics, probe=real, with_entropy=False)
                cpu_mb.fields["old_logp"] = fo.logp.float().cpu()
            if b.ref is not None:
                cpu_mb.fields["ref_logp"] = (
                    b.forward_model(
                        b.ref,
                        mb,
                        temperature=mb.temperature,
                        replay=b.replay,
                        with_entropy=False,
                    )
                    .logp.float()
                    .cpu()
                )
            if b.teacher is not None:
                cpu_mb.fields["teacher_logp"] = (
                    b.forward_model(
                        b.teacher,
                        mb,
                        temperature=mb.temperature,
                        replay=False,  # another model: the student's routes do not apply
                        with_entropy=False,
                    )
                    .logp.float()
                    .cpu()
                )
            if b.critic is not None:
                routes = mb.routed_experts.unsqueeze(0) if mb.routed_experts is not None else None
                cpu_mb.fields["old_values"] = b.critic(mb, routes).cpu()

    def _advantages(
        self, samples: list[TrainSample], plans: list[list[MicroBatch]], metrics: StepMetrics
    ) -> None:
        """Fill `fields['adv']` (and `returns` for ppo) of every micro-batch."""
        b = self.b
        cfg, ac = b.cfg, b.cfg.advantage
        mbs = [mb for p in plans for mb in p if mb.num_seqs]
        tok: dict[str, dict[int, torch.Tensor]] = {}
        for mb in mbs:
            # the response view holds each sequence's tokens contiguously, in packing order
            counts = [samples[sid].response_ids.size for sid in mb.sample_ids]
            for name, t in mb.fields.items():
                tok.setdefault(name, {}).update(zip(mb.sample_ids, t.split(counts), strict=True))
        n = len(samples)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        masks = [torch.from_numpy(s.loss_mask) for s in samples]
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
                advs = whiten(advs, masks, b.coll.sum)
        else:
            tr = token_rewards(rewards.tolist(), masks, kl, cfg.loss.kl_coef)
            values = [tok["old_values"][i] for i in range(n)]
            advs, rets = gae(tr, values, ac.gamma, ac.lam)
            if ac.whiten:
                advs = whiten(advs, masks, b.coll.sum)
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
            if b.cfg.correction.old_logprobs == "rollout":
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
                stale = b.weight_version - sampled
                metrics.add_mean("train/staleness", float(stale.sum()), float(stale.size))

    def _optimize(self, plan: list[MicroBatch], metrics: StepMetrics) -> float:
        """Forward/backward over the mini-batch's micro-batches, then clip and step. A non-finite
        gradient norm takes no step (the backend skips it): counted, and its micro-batch found
        and logged (trainer/nonfinite.py)."""
        b = self.b
        local = torch.zeros(2, dtype=torch.float64)
        for mb in plan:
            local += local_denominators(mb.loss_mask, mb.resp_seq, mb.num_seqs)
        tot = b.coll.sum(local)
        denom = Denominators(tokens=float(tot[0]), seqs=float(tot[1]))
        b.opt.zero_grad(set_to_none=True)
        for cpu_mb in plan:
            self._backward(cpu_mb, denom, metrics)
        norm = b.clip_and_step()
        if not math.isfinite(norm):
            self.skipped += 1
            self.last_culprit = culprit = self._explain_nonfinite(plan, denom)
            log.warning("nonfinite_grad_skipped", step=b.step, grad_norm=str(norm),
                        skipped_total=self.skipped, culprit=culprit or "none alone (their sum overflowed)")
        return norm

    def _explain_nonfinite(self, plan: list[MicroBatch], denom: Denominators) -> dict[str, object]:
        """The micro-batch whose own gradient is not finite, and (one rank) where its NaN comes from."""
        b = self.b

        def run_one(mb: MicroBatch) -> MicroBatch:
            return self._backward(mb, denom, StepMetrics())

        def params() -> Iterable[tuple[str, torch.nn.Parameter]]:
            return b.policy.named_parameters()

        def zero() -> None:
            b.opt.zero_grad(set_to_none=True)

        culprit = find_culprit(plan, run_one, params, zero)
        idx = culprit.get("micro_batch")
        one_rank = not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1
        if isinstance(idx, int) and one_rank:  # replays on one rank only: no collectives to match
            culprit["diagnosis"] = diagnose(plan[idx], run_one, params, zero, b.device.type == "cuda")
        return culprit

    def _backward(self, cpu_mb: MicroBatch, denom: Denominators, metrics: StepMetrics) -> MicroBatch:
        """One micro-batch's forward and backward (gradients accumulate); returns its device copy."""
        b = self.b
        cfg = b.cfg
        mb = cpu_mb.to(b.device)
        probe = self.old_is_current and mb.num_seqs > 0
        fo = self._policy_forward(mb, metrics, probe=probe, with_entropy=True)
        if self.old_is_current and mb.num_seqs:
            mb.fields["old_logp"] = fo.logp.detach()  # the recompute pass's value, exactly
        if not mb.num_seqs:
            assert fo.logits is not None  # a filler's forward returns logits (ForwardOut)
            loss = fo.logits.sum() * 0.0
            if b.critic is not None:
                loss = loss + b.critic(mb).sum() * 0.0
            (loss * b.world).backward()
            return mb
        f = mb.fields
        values = None
        if b.critic is not None:
            routes = mb.routed_experts.unsqueeze(0) if mb.routed_experts is not None else None
            values = b.critic(mb, routes)
        x = LossInputs(
            logp=fo.logp,
            old_logp=f.get("old_logp"),
            rollout_logp=f["rollout_logp"] if self.rollout_lp else None,
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
        (loss * b.world).backward()
        return mb
