"""`FlowUNet`: a small conditional UNet that predicts the flow-matching velocity.

Flow matching here is rectified flow: x_t = (1 - t) x_0 + t eps, t in [0, 1], t = 1 is pure
noise, and the network predicts v = eps - x_0. Condition: a shape class (data.SHAPES) or the
null class ("any shape"). The net is small enough to pretrain from scratch on CPU in a minute.

Every leaf layer casts its input to its own weight's dtype, so a model whose parameters are
partly BF16 and partly FP32 (per-parameter FP32, diffusion/precision.py) runs without any
autocast: each layer computes in the dtype it is stored in, and the output is FP32.
Weights are saved and loaded with safetensors, under their module names (the names the
engine's weight sync and the per-parameter FP32 patterns use).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from miles.core.errors import ConfigError
from miles.diffusion.data import NUM_CLASSES


@dataclass(frozen=True)
class FlowUNetSpec:
    channels: int = 32  # width at full resolution; 2x at half resolution
    emb_dim: int = 64  # time + condition embedding width
    image_size: int = 16
    in_channels: int = 3
    num_classes: int = NUM_CLASSES  # the null class is one more embedding row


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


class Conv(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


class Norm(nn.GroupNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of t in [0, 1] (scaled to 0..1000 as in DDPM-style nets), FP32."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    ang = t.float()[:, None] * 1000.0 * freqs[None]
    return torch.cat([ang.sin(), ang.cos()], dim=1)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, emb: int) -> None:
        super().__init__()
        self.norm1 = Norm(8, cin)
        self.conv1 = Conv(cin, cout, 3, padding=1)
        self.emb = Linear(emb, 2 * cout)  # per-channel scale and shift from time + condition
        self.norm2 = Norm(8, cout)
        self.conv2 = Conv(cout, cout, 3, padding=1)
        self.skip = Conv(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.emb(F.silu(e)).chunk(2, dim=1)
        h = self.norm2(h)
        h = h * (1 + scale[:, :, None, None].to(h.dtype)) + shift[:, :, None, None].to(h.dtype)
        h = self.conv2(F.silu(h))
        s = x if self.skip is None else self.skip(x)
        return s.to(h.dtype) + h


class FlowUNet(nn.Module):
    def __init__(self, spec: FlowUNetSpec | None = None) -> None:
        super().__init__()
        self.spec = s = spec or FlowUNetSpec()
        c, e = s.channels, s.emb_dim
        self.time_embed = nn.Sequential(Linear(e, e), nn.SiLU(), Linear(e, e))
        self.cond_embed = nn.Embedding(s.num_classes + 1, e)
        self.conv_in = Conv(s.in_channels, c, 3, padding=1)
        self.down1 = ResBlock(c, c, e)
        self.pool = Conv(c, 2 * c, 3, stride=2, padding=1)
        self.down2 = ResBlock(2 * c, 2 * c, e)
        self.mid = ResBlock(2 * c, 2 * c, e)
        self.up = Conv(2 * c, c, 3, padding=1)
        self.up1 = ResBlock(2 * c, c, e)
        self.norm_out = Norm(8, c)
        self.conv_out = Conv(c, s.in_channels, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Velocity [N, C, H, W] (FP32) at latents `x` [N, C, H, W], times `t` [N], classes `cond` [N]."""
        feats = timestep_features(t, self.spec.emb_dim)
        emb = self.time_embed(feats).float() + self.cond_embed(cond).float()
        h0 = self.conv_in(x)
        h1 = self.down1(h0, emb)
        h2 = self.down2(self.pool(h1), emb)
        h2 = self.mid(h2, emb)
        u = self.up(F.interpolate(h2.to(self.up.weight.dtype), scale_factor=2.0, mode="nearest"))
        h = self.up1(torch.cat([u, h1.to(u.dtype)], dim=1), emb)
        return self.conv_out(F.silu(self.norm_out(h))).float()


def build_flow_unet(spec: FlowUNetSpec | None = None, seed: int = 0) -> FlowUNet:
    """A freshly initialised model; the same seed gives the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = FlowUNet(spec)
    nn.init.zeros_(model.conv_out.weight)  # start as the zero velocity: a calm first few hundred steps
    assert model.conv_out.bias is not None  # conv_out is built with a bias
    nn.init.zeros_(model.conv_out.bias)
    return model


def save_weights(model: nn.Module, path: str | Path) -> None:
    """Weights (each in its stored dtype) to one safetensors file, with the spec in its metadata."""
    spec = cast(FlowUNetSpec, model.spec)  # a FlowUNet's (any module that carries one)
    meta = {k: str(v) for k, v in spec.__dict__.items()}
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(path), meta)


def load_weights(path: str | Path, spec: FlowUNetSpec | None = None) -> FlowUNet:
    """A model from a safetensors file written by `save_weights` (FP32 unless the file is not)."""
    from safetensors import safe_open

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"diffusion checkpoint {str(p)!r} does not exist")
    if spec is None:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
        spec = FlowUNetSpec(**{k: int(v) for k, v in meta.items() if k in FlowUNetSpec.__dataclass_fields__})
    model = FlowUNet(spec)
    state = load_file(str(p))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(f"diffusion checkpoint {str(p)!r}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model
