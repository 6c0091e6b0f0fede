"""Rewards of the diffusion recipe, pluggable by import path (`reward.fn`).

A reward is a callable `(images [N, 3, H, W] in [-1, 1], conditions [N] long) -> [N] float`.
`reward.fn` names either such a callable or a class that is built once with the run's
`RewardConfig` and then called (for rewards with state, like a classifier).

Built in:
- `ClassifierReward`: probability that a small CNN (diffusion/classifier.py), trained in the
  recipe, sees the target shape ("is this a circle").
- `red_left`: a rule reward, how red the left half of the image is versus the right half.
- `centred`: a rule reward, how close the brightness centroid is to the image centre.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from miles.core.errors import ConfigError
from miles.core.hooks import resolve_import_path
from miles.diffusion.classifier import load_classifier, save_classifier, train_classifier
from miles.diffusion.config import RewardConfig
from miles.diffusion.data import SHAPES

RewardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _unit(images: torch.Tensor) -> torch.Tensor:
    return (images.float().clamp(-1, 1) + 1) / 2  # [0, 1]


def red_left(images: torch.Tensor, conditions: torch.Tensor) -> torch.Tensor:
    """Mean redness (R - (G + B) / 2, clipped at 0) of the left half minus that of the right
    half, in [-1, 1]."""
    x = _unit(images)
    red = (x[:, 0] - 0.5 * (x[:, 1] + x[:, 2])).clamp(min=0)
    w = red.shape[-1] // 2
    return red[..., :w].mean((1, 2)) - red[..., w:].mean((1, 2))


def centred(images: torch.Tensor, conditions: torch.Tensor) -> torch.Tensor:
    """1 - (distance of the brightness centroid from the centre) / half the image side, in [0, 1]
    (an all-dark image scores 0)."""
    x = _unit(images).mean(1)  # [N, H, W]
    n, h, w = x.shape
    mass = x.sum((1, 2))
    ys = torch.arange(h, dtype=torch.float32)[None, :, None] + 0.5
    xs = torch.arange(w, dtype=torch.float32)[None, None, :] + 0.5
    cy = (x * ys).sum((1, 2)) / mass.clamp(min=1e-6)
    cx = (x * xs).sum((1, 2)) / mass.clamp(min=1e-6)
    d = torch.sqrt((cy - h / 2) ** 2 + (cx - w / 2) ** 2) / (h / 2)
    return torch.where(mass > 1e-3, (1 - d).clamp(min=0), torch.zeros_like(d))


class ClassifierReward:
    """P(target shape) under a small classifier; trains (and saves) one when none is given."""

    def __init__(self, cfg: RewardConfig, run_dir: str = "") -> None:
        self.target = SHAPES.index(cfg.target)
        self.accuracy: float | None = None
        if cfg.classifier:
            self.clf = load_classifier(cfg.classifier)
        else:
            clf, self.accuracy = train_classifier(cfg.classifier_steps)
            self.clf = clf.eval()
            if run_dir:
                save_classifier(self.clf, Path(run_dir) / "classifier.safetensors")

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, conditions: torch.Tensor) -> torch.Tensor:
        return self.clf(images.float().clamp(-1, 1)).softmax(1)[:, self.target]


def load_reward(cfg: RewardConfig, run_dir: str = "") -> RewardFn:
    """The reward named by `cfg.fn`, built if it is a class; ConfigError naming the field if not usable."""
    obj = resolve_import_path(cfg.fn, "reward.fn")
    if isinstance(obj, type):
        try:
            obj = obj(cfg, run_dir) if obj is ClassifierReward else obj(cfg)
        except TypeError as exc:
            raise ConfigError(f"reward.fn={cfg.fn!r}: a reward class is built as Class(RewardConfig): {exc}") from exc
    if not callable(obj):
        raise ConfigError(f"reward.fn={cfg.fn!r} is not callable")
    return obj
