"""The SDE sampler: flow matching's ODE turned into an SDE with the same marginals, so every
denoising step is a Gaussian transition whose log-probability the trainer can recompute.

Rectified flow: x_t = (1 - t) x0 + t eps (t = 1 is noise) and the net predicts v = eps - x0.
Then E[eps | x_t] = x_t + (1 - t) v and the score is -(x_t + (1 - t) v) / t. A reverse-time
SDE with diffusion sigma_t and the ODE's marginals has drift v + sigma_t^2 / (2 t) * (x_t +
(1 - t) v) (time running down, Flow-GRPO's form). One Euler-Maruyama step from t to s < t,
h = t - s:

    mean = x_t - h * (v + sigma_t^2 / (2 t) * (x_t + (1 - t) v)),  std = sigma_t * sqrt(h)
    x_s  = mean + std * z,  z ~ N(0, I)

with sigma_t = noise_level * sqrt(t / (1 - t)), t clipped to the second grid time so the
first step (t = 1) stays finite. The recorded log-probability of a transition is the
Gaussian log-density of x_s under N(mean, std^2), averaged over the image's elements (the
per-element mean keeps ratios of a 768-element image in the same range as a token's).

Latents and the update arithmetic are FP32 whatever the net's dtype: only the velocity comes
from a (possibly BF16) forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

Velocity = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass(frozen=True)
class SDESchedule:
    steps: int = 8  # denoising steps per image
    noise_level: float = 0.7  # `a` in sigma_t = a * sqrt(t / (1 - t))

    def times(self) -> torch.Tensor:
        """Grid t_0 = 1 > t_1 > ... > t_steps = 0, FP32 [steps + 1]."""
        return torch.linspace(1.0, 0.0, self.steps + 1, dtype=torch.float32)

    def sigma(self, t: torch.Tensor) -> torch.Tensor:
        t_max = 1.0 - 1.0 / self.steps
        tc = t.clamp(max=t_max)
        return self.noise_level * torch.sqrt(tc / (1.0 - tc))


def step_mean_std(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, s: torch.Tensor,
                  sched: SDESchedule) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean [N, ...] and std [N, 1, 1, 1] of x_s given x_t (`x`), velocity `v`, times t > s [N]."""
    x, v = x.float(), v.float()
    shape = (-1,) + (1,) * (x.dim() - 1)
    tt, h = t.float().view(shape), (t - s).float().view(shape)
    sig = sched.sigma(t.float()).view(shape)
    drift = v + sig * sig / (2.0 * tt) * (x + (1.0 - tt) * v)
    return x - h * drift, sig * torch.sqrt(h)


def gaussian_logprob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-sample log N(x_next; mean, std^2), averaged over the non-batch elements: [N], FP32."""
    z = (x_next.float() - mean) / std
    lp = -0.5 * z * z - torch.log(std) - _LOG_SQRT_2PI
    return lp.flatten(1).mean(1)


def gaussian_kl(mean_p: torch.Tensor, mean_q: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(N(mean_p, std^2) || N(mean_q, std^2)) per element, averaged per sample: [N].
    Exact for two transitions of the same step (same std), as policy and reference are."""
    d = (mean_p - mean_q) / std
    return (0.5 * d * d).flatten(1).mean(1)


@dataclass
class Trajectories:
    """A batch of sampled denoising trajectories (all FP32, on the CPU).

    latents[:, i] is x at times[i]; transition i goes latents[:, i] -> latents[:, i + 1]
    and has log-probability logprobs[:, i] under the weights of version versions[:, i].
    """

    latents: torch.Tensor  # [N, steps + 1, C, H, W]
    logprobs: torch.Tensor  # [N, steps]
    times: torch.Tensor  # [steps + 1]
    conditions: torch.Tensor  # [N] long

    @property
    def images(self) -> torch.Tensor:
        return self.latents[:, -1]


def initial_noise(seeds: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    """x at t = 1 for each seed: standard normal drawn from a per-seed generator, so a sample's
    noise does not depend on which other samples share its batch."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in seeds])


def step_noise(gens: list[torch.Generator], shape: tuple[int, ...]) -> torch.Tensor:
    return torch.stack([torch.randn(shape, generator=g) for g in gens])


@torch.no_grad()
def sample_sde(velocity: Velocity, conditions: torch.Tensor, seeds: list[int], shape: tuple[int, ...],
               sched: SDESchedule) -> Trajectories:
    """Sample every trajectory to t = 0 in one batch, recording latents and log-probabilities
    (the synchronous form of the engine's step loop, for tests, evaluation and benches)."""
    gens = [torch.Generator().manual_seed(s ^ 0x5DEECE66D) for s in seeds]
    x = initial_noise(seeds, shape)
    ts = sched.times()
    lat, lps = [x], []
    for i in range(sched.steps):
        t = ts[i].expand(len(seeds))
        s = ts[i + 1].expand(len(seeds))
        v = velocity(x, t, conditions)
        mean, std = step_mean_std(x, v, t, s, sched)
        x = mean + std * step_noise(gens, shape)
        lps.append(gaussian_logprob(x, mean, std))
        lat.append(x)
    return Trajectories(torch.stack(lat, 1), torch.stack(lps, 1), ts, conditions)
