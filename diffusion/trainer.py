"""`DiffusionTrainer`: GRPO over denoising trajectories, on FSDP2 like the LLM trainer.

A trajectory is `steps` Gaussian transitions x_{t_i} -> x_{t_{i+1}}; each is a "token" of
the policy-gradient loss. Per step: group-normalised rewards (trainer/advantages.py) give
one advantage per trajectory, shared by its transitions; a no-grad pass recomputes each
transition's old log-probability (or the engine's is reused); per mini-batch the current
log-probability gives the ratio exp(logp - logp_old), clipped PPO-style, times the
rollout/trainer correction weight (trainer/corrections.py: TIS, Clip-or-Pop, MIS, OPSM, with
transitions as tokens and trajectories as sequences). The optional KL to the reference
policy is exact: both transitions share the step's std, so KL = |mean - mean_ref|^2 / (2 std^2).

FSDP2: each top-level module of the UNet is its own `fully_shard` unit, then the root. The
compute dtype is a unit's MixedPrecisionPolicy; per-parameter FP32 keeps a unit whose
parameters all match `precision.fp32_params` in FP32 (a unit mixing both is split into its
children). Master weights and AdamW state are FP32 throughout. One rank on CPU uses gloo.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from miles.core.errors import TrainerError
from miles.core.logging import get_logger
from miles.diffusion.config import DiffusionTrainerConfig, PrecisionConfig
from miles.diffusion.model import FlowUNet, FlowUNetSpec
from miles.diffusion.precision import dtype_of, keeps_fp32, param_dtypes
from miles.diffusion.sampler import SDESchedule, gaussian_kl, gaussian_logprob, step_mean_std
from miles.trainer.advantages import group_advantages
from miles.trainer.corrections import apply_corrections, finish_ess
from miles.trainer.deterministic import enable_deterministic
from miles.trainer.dist import Collectives, ensure_process_group
from miles.trainer.metrics import StepMetrics
from miles.trainer.sharding import make_mesh

log = get_logger("miles.diffusion.trainer")


@dataclass
class DiffusionBatch:
    """The trajectories of one training step (CPU tensors)."""

    latents: torch.Tensor  # [N, steps + 1, C, H, W] float32
    rollout_logp: torch.Tensor  # [N, steps] float32
    versions: torch.Tensor  # [N, steps] int64
    conditions: torch.Tensor  # [N] long
    rewards: torch.Tensor  # [N] float32
    groups: torch.Tensor  # [N] long: trajectories of one prompt share a group id

    def __post_init__(self) -> None:
        n, t1 = self.latents.shape[:2]
        for name, want in (("rollout_logp", (n, t1 - 1)), ("versions", (n, t1 - 1)), ("conditions", (n,)),
                           ("rewards", (n,)), ("groups", (n,))):
            got = tuple(getattr(self, name).shape)
            if got != want:
                raise TrainerError(f"DiffusionBatch.{name}: shape {got}, expected {want}")
        if not torch.isfinite(self.rewards).all():
            raise TrainerError("DiffusionBatch.rewards: not all finite")


def _units(model: nn.Module, patterns: list[str], prefix: str = "") -> list[tuple[nn.Module, bool]]:
    """(module, all its parameters FP32?) for the FSDP units below `model`'s root."""
    out: list[tuple[nn.Module, bool]] = []
    for name, child in model.named_children():
        names = [f"{prefix}{name}.{n}" for n, _ in child.named_parameters()]
        if not names:
            continue
        flags = [keeps_fp32(n, patterns) for n in names]
        if all(flags) or not any(flags):
            out.append((child, all(flags)))
        else:
            out.extend(_units(child, patterns, f"{prefix}{name}."))
    return out


def shard_flow(model: nn.Module, dtype: torch.dtype, fp32_patterns: list[str]) -> nn.Module:
    """fully_shard every unit (FP32 policy for the FP32-pattern ones), then the root."""
    mesh = make_mesh(torch.device("cpu"), 1)
    low = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 \
        else MixedPrecisionPolicy()
    for unit, fp32 in _units(model, fp32_patterns if dtype != torch.float32 else []):
        fully_shard(unit, mesh=mesh, mp_policy=MixedPrecisionPolicy() if fp32 else low)
    # The root holds no parameters of its own here; its policy casts nothing it owns.
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy())
    return model


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


class DiffusionTrainer:
    """One FSDP2 rank (world 1 on CPU) training a FlowUNet with GRPO over trajectories."""

    def __init__(self, cfg: DiffusionTrainerConfig, prec: PrecisionConfig, sched: SDESchedule,
                 spec: FlowUNetSpec, init_state: dict[str, torch.Tensor], *, seed: int = 0,
                 weight_version: int = 0) -> None:
        self.cfg, self.prec, self.sched, self.seed = cfg, prec, sched, seed
        if prec.deterministic:
            enable_deterministic(seed)
        self.device = torch.device("cpu")
        ensure_process_group(0, 1, self.device)
        self.dtype = dtype_of(prec.trainer_dtype, "precision.trainer_dtype")
        self.policy = self._build(spec, init_state)
        self.ref: nn.Module | None = None
        if cfg.kl_coef:
            self.ref = self._build(spec, init_state).requires_grad_(False)
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.coll = Collectives(self.device)
        self.step = 0
        self.weight_version = weight_version

    def _build(self, spec: FlowUNetSpec, state: dict[str, torch.Tensor]) -> nn.Module:
        model = FlowUNet(spec)
        model.load_state_dict({k: v.float() for k, v in state.items()})
        return shard_flow(model, self.dtype, self.prec.fp32_params)

    # ---------------------------------------------------------------- log-probabilities
    def _transitions(self, model: nn.Module, b: DiffusionBatch, rows: torch.Tensor,
                     cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mean [M, ...], std [M, 1, 1, 1] and log-prob [M] of transitions (trajectory rows[k], step cols[k])."""
        ts = self.sched.times()
        x, x_next = b.latents[rows, cols], b.latents[rows, cols + 1]
        t, s = ts[cols], ts[cols + 1]
        v = model(x, t, b.conditions[rows])
        mean, std = step_mean_std(x, v, t, s, self.sched)
        return mean, std, gaussian_logprob(x_next, mean, std)

    def _chunks(self, rows: torch.Tensor, cols: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        mb = self.cfg.micro_batch
        for i in range(0, rows.numel(), mb):
            yield rows[i:i + mb], cols[i:i + mb]

    @torch.no_grad()
    def logprobs(self, b: DiffusionBatch, model: nn.Module | None = None) -> torch.Tensor:
        """Log-probability [N, steps] of every recorded transition under `model` (the policy)."""
        n, steps = b.rollout_logp.shape
        rows, cols = _grid(n, steps)
        out = [self._transitions(model or self.policy, b, r, c)[2] for r, c in self._chunks(rows, cols)]
        return torch.cat(out).view(n, steps)

    @torch.no_grad()
    def _means(self, model: nn.Module, b: DiffusionBatch) -> torch.Tensor:
        n, steps = b.rollout_logp.shape
        rows, cols = _grid(n, steps)
        out = [self._transitions(model, b, r, c)[0] for r, c in self._chunks(rows, cols)]
        return torch.cat(out).view(n, steps, *b.latents.shape[2:])

    # ---------------------------------------------------------------- the step
    def train_step(self, b: DiffusionBatch) -> dict[str, float]:
        cfg = self.cfg
        t0 = time.perf_counter()
        n, steps = b.rollout_logp.shape
        metrics = StepMetrics()
        adv = group_advantages(b.rewards, b.groups, std_normalize=cfg.std_normalize).clamp(-cfg.adv_clip, cfg.adv_clip)
        if cfg.correction.old_logprobs == "recompute":
            old = self.logprobs(b)
        else:
            old = b.rollout_logp.clone()
        diff = (old - b.rollout_logp).abs()
        fresh = b.versions == self.weight_version  # sampled by the weights the trainer holds now
        metrics.add_mean("train/logp_abs_diff", float(diff.sum()), diff.numel())
        metrics.add_max("train/logp_abs_diff_max", float(diff.max()))
        if fresh.any():
            metrics.add_mean("train/logp_abs_diff_fresh", float(diff[fresh].sum()), float(fresh.sum()))
        ref_mean = self._means(self.ref, b) if self.ref is not None else None
        metrics.add_mean("train/reward", float(b.rewards.sum()), n)
        stale = (self.weight_version - b.versions).float()
        metrics.add_mean("train/staleness", float(stale.sum()), stale.numel())
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step)
        uniq = torch.unique(b.groups)
        order = uniq[torch.randperm(uniq.numel(), generator=g)]
        norms = []
        for part in order.tensor_split(min(cfg.mini_batches, uniq.numel())):
            sel = torch.nonzero(torch.isin(b.groups, part)).flatten()
            norms.append(self._update(b, sel, adv, old, ref_mean, metrics))
        out = metrics.reduce(self.coll.sum, self.coll.max)
        finish_ess(out)
        self.step += 1
        self.weight_version += 1
        out.update({"train/grad_norm": float(np.mean(norms)), "train/step_time_s": time.perf_counter() - t0,
                    "train/step": float(self.step), "train/weight_version": float(self.weight_version),
                    "train/transitions": float(n * steps)})
        return out

    def _update(self, b: DiffusionBatch, sel: torch.Tensor, adv: torch.Tensor, old: torch.Tensor,
                ref_mean: torch.Tensor | None, metrics: StepMetrics) -> float:
        cfg = self.cfg
        steps = b.rollout_logp.shape[1]
        rows = sel.repeat_interleave(steps)
        cols = torch.arange(steps).repeat(sel.numel())
        total = rows.numel()
        self.opt.zero_grad(set_to_none=True)
        for r, c in self._chunks(rows, cols):
            mean, std, logp = self._transitions(self.policy, b, r, c)
            a = adv[r]
            o = old[r, c]
            local = torch.unique(r, return_inverse=True)[1]
            corr = apply_corrections(cfg.correction, old_logp=o, rollout_logp=b.rollout_logp[r, c], cur_logp=logp,
                                     adv=a, mask=torch.ones_like(logp), seq=local, num_seqs=int(local.max()) + 1,
                                     metrics=metrics)
            ratio = torch.exp((logp - o).clamp(-20.0, 20.0))
            clipped = ratio.clamp(1 - cfg.eps_clip, 1 + cfg.eps_clip)
            pg = -torch.minimum(ratio * a, clipped * a) * corr.weight * corr.keep
            loss = pg.sum() / total
            metrics.add_mean("train/pg_loss", float(pg.detach().sum()), total)
            metrics.add_mean("train/clip_fraction", float(((ratio - 1).abs() > cfg.eps_clip).float().sum()), total)
            metrics.add_mean("train/ratio", float(ratio.detach().sum()), total)
            if ref_mean is not None:
                kl = gaussian_kl(mean, ref_mean[r, c], std)
                loss = loss + cfg.kl_coef * kl.sum() / total
                metrics.add_mean("train/kl", float(kl.detach().sum()), total)
            loss.backward()
        clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        norm = _full(torch.nn.utils.clip_grad_norm_(list(self.policy.parameters()), clip))
        self.opt.step()
        return float(norm)

    # ---------------------------------------------------------------- weights
    def export_state(self, engine_dtype: torch.dtype, fp32_patterns: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) of every policy weight, each in the dtype the engine holds it in
        (so the sync's checksums compare like with like)."""
        want = param_dtypes(self.policy, engine_dtype, fp32_patterns)
        for name, p in self.policy.named_parameters():
            yield name, _full(p.detach()).to(want[name]).contiguous()

    def state_fp32(self) -> dict[str, torch.Tensor]:
        return {n: _full(p.detach()).float().clone() for n, p in self.policy.named_parameters()}


def _grid(n: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n).repeat_interleave(steps), torch.arange(steps).repeat(n)
