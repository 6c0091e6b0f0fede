"""The SDE sampler: its recorded log-probabilities are the Gaussian densities of the sampled
transitions, and it is the process the engine and the trainer both compute."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Normal

from miles.diffusion.model import FlowUNetSpec, build_flow_unet
from miles.diffusion.sampler import SDESchedule, gaussian_kl, sample_sde, step_mean_std

pytestmark = pytest.mark.timeout(60)
SPEC = FlowUNetSpec(channels=8, emb_dim=16)


def _net() -> torch.nn.Module:
    net = build_flow_unet(SPEC, seed=3)
    with torch.no_grad():  # a non-zero output layer, so the velocity is not trivially 0
        net.conv_out.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return net.eval()


def test_logprobs_match_a_direct_gaussian_density() -> None:
    net, sched = _net(), SDESchedule(steps=6, noise_level=0.7)
    cond = torch.tensor([0, 1, 2, 3])
    tr = sample_sde(net, cond, [11, 12, 13, 14], (3, 16, 16), sched)
    ts = sched.times()
    assert tr.latents.shape == (4, 7, 3, 16, 16) and tr.logprobs.shape == (4, 6)
    for i in range(sched.steps):
        x, x_next = tr.latents[:, i], tr.latents[:, i + 1]
        t, s = ts[i].expand(4), ts[i + 1].expand(4)
        with torch.no_grad():
            v = net(x, t, cond)
        # the drift written out independently of sampler.step_mean_std
        sigma = 0.7 * ((t.clamp(max=1 - 1 / 6)) / (1 - t.clamp(max=1 - 1 / 6))).sqrt().view(-1, 1, 1, 1)
        tt, h = t.view(-1, 1, 1, 1), (t - s).view(-1, 1, 1, 1)
        mean = x - h * (v + sigma**2 / (2 * tt) * (x + (1 - tt) * v))
        std = sigma * h.sqrt()
        direct = Normal(mean.double(), std.double().expand_as(mean)).log_prob(x_next.double()).flatten(1).mean(1)
        torch.testing.assert_close(tr.logprobs[:, i].double(), direct, atol=1e-5, rtol=0)


def test_same_seed_same_trajectory_whatever_the_batch() -> None:
    net, sched = _net(), SDESchedule(steps=4)
    a = sample_sde(net, torch.tensor([3, 0]), [5, 6], (3, 16, 16), sched)
    b = sample_sde(net, torch.tensor([1, 3, 2]), [9, 5, 7], (3, 16, 16), sched)
    torch.testing.assert_close(a.latents[0], b.latents[1], atol=1e-6, rtol=0)
    assert not torch.equal(a.latents[0, -1], a.latents[1, -1])


def test_noise_keeps_unit_scale_and_kl_is_zero_between_equal_means() -> None:
    sched = SDESchedule(steps=8, noise_level=0.7)
    x = torch.randn(64, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    mean, std = step_mean_std(x, torch.zeros_like(x), torch.ones(64), torch.full((64,), 7 / 8), sched)
    assert float(std.min()) > 0
    assert gaussian_kl(mean, mean, std).abs().max() == 0
    assert float(gaussian_kl(mean, mean + std, std).mean()) == pytest.approx(0.5)
