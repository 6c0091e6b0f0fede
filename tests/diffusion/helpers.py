"""Shared pieces of the diffusion tests: a tiny model and one batch of recorded trajectories."""

from __future__ import annotations

import torch

from miles.diffusion.model import FlowUNet, FlowUNetSpec, build_flow_unet
from miles.diffusion.sampler import SDESchedule, sample_sde
from miles.diffusion.trainer import DiffusionBatch

SPEC = FlowUNetSpec(channels=8, emb_dim=16)
SCHED = SDESchedule(steps=4, noise_level=0.7)


def tiny_net(seed: int = 3) -> FlowUNet:
    """A small net with a non-zero output layer (a fresh one predicts v = 0 exactly)."""
    net = build_flow_unet(SPEC, seed=seed)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return net


def batch_from(net: torch.nn.Module, groups: int = 2, n: int = 4, seed: int = 0) -> DiffusionBatch:
    """Trajectories sampled by `net` (FP32), rewards from the images' mean red channel."""
    cond = torch.arange(groups).repeat_interleave(n) % 4
    seeds = [seed * 1000 + i for i in range(groups * n)]
    tr = sample_sde(net, cond, seeds, (3, 16, 16), SCHED)
    rewards = tr.images[:, 0].mean((1, 2))
    return DiffusionBatch(tr.latents, tr.logprobs, torch.zeros_like(tr.logprobs, dtype=torch.long), cond,
                          rewards.float(), torch.arange(groups).repeat_interleave(n))
