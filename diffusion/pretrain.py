"""Flow-matching pretraining of the policy from scratch on procedurally drawn shapes.

Loss: || v_theta(x_t, t, c) - (eps - x0) ||^2 at x_t = (1 - t) x0 + t eps, t ~ U(0, 1).
The class label is replaced by the null class ("any shape") with probability `p_uncond`,
so one net serves both the conditional and the unconditional prompt. FP32, CPU, seeded:
the same seed and step count give the same weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from miles.core.logging import get_logger
from miles.diffusion.data import NULL_CLASS, shape_batch
from miles.diffusion.model import FlowUNet, FlowUNetSpec, build_flow_unet

log = get_logger("miles.diffusion.pretrain")


@dataclass(frozen=True)
class PretrainPlan:
    steps: int = 1500
    batch: int = 64
    lr: float = 2e-3
    p_uncond: float = 0.3
    seed: int = 0
    time_budget_s: float = 0.0  # stop early once this much time passed; 0 = run all steps


def pretrain(spec: FlowUNetSpec, plan: PretrainPlan) -> tuple[FlowUNet, list[float]]:
    """A pretrained model and its per-step loss curve."""
    model = build_flow_unet(spec, plan.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=plan.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(plan.seed + 1)
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(plan.steps):
        x0, labels = shape_batch(plan.batch, spec.image_size, g)
        drop = torch.rand(plan.batch, generator=g) < plan.p_uncond
        cond = torch.where(drop, torch.full_like(labels, NULL_CLASS), labels)
        eps = torch.randn(x0.shape, generator=g)
        t = torch.rand(plan.batch, generator=g)
        tt = t.view(-1, 1, 1, 1)
        xt = (1 - tt) * x0 + tt * eps
        lr = plan.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * (1 - step / plan.steps))
        for grp in opt.param_groups:
            grp["lr"] = lr
        loss = ((model(xt, t, cond) - (eps - x0)) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if step % 200 == 0:
            log.info("pretrain_step", step=step, loss=round(losses[-1], 4))
        if plan.time_budget_s and time.perf_counter() - t0 > plan.time_budget_s:
            log.info("pretrain_time_budget_reached", step=step, seconds=round(time.perf_counter() - t0, 1))
            break
    return model, losses
