"""Procedurally drawn 16x16 RGB shapes: the pretraining set of the diffusion policy.

Each image is one filled shape (circle, square or triangle) of a random bright colour at a
random position and size on a dark background, in [-1, 1]. Drawing is vectorised over the
batch (coordinate grids compared against each shape's equation), so a batch of thousands
takes milliseconds. Everything is drawn from the given generator: same seed, same images.
"""

from __future__ import annotations

import torch

SHAPES = ("circle", "square", "triangle")
NUM_CLASSES = len(SHAPES)
NULL_CLASS = NUM_CLASSES  # the "any shape" condition (classifier-free label dropout)


def draw_shapes(labels: torch.Tensor, size: int = 16, generator: torch.Generator | None = None) -> torch.Tensor:
    """Images [N, 3, size, size] in [-1, 1], one shape per image of the class in `labels` [N]."""
    n = labels.numel()
    g = generator
    r = size * (0.22 + 0.12 * torch.rand(n, generator=g))  # half-extent in pixels
    cx = r + (size - 2 * r) * torch.rand(n, generator=g)
    cy = r + (size - 2 * r) * torch.rand(n, generator=g)
    colour = 0.5 + 0.5 * torch.rand(n, 3, generator=g)  # bright: every channel >= 0.5 before mixing
    colour = colour * (torch.rand(n, 3, generator=g) > 0.3).float()  # drop some channels -> hues
    colour[colour.sum(1) == 0, 0] = 1.0
    ys, xs = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    dx = xs[None] - cx[:, None, None]
    dy = ys[None] - cy[:, None, None]
    rr = r[:, None, None]
    circle = dx * dx + dy * dy <= rr * rr
    square = (dx.abs() <= rr * 0.85) & (dy.abs() <= rr * 0.85)
    # upward triangle: below the two slanted edges, above the base
    triangle = (dy <= rr * 0.8) & (dy >= -rr) & (dx.abs() <= (dy + rr) * 0.6)
    lab = labels[:, None, None]
    mask = torch.where(lab == 0, circle, torch.where(lab == 1, square, triangle)).float()
    img = mask[:, None] * colour[:, :, None, None]
    return img * 2.0 - 1.0


def shape_batch(n: int, size: int = 16, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of `n` random shapes (classes uniform): (images [n, 3, size, size], labels [n])."""
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=generator)
    return draw_shapes(labels, size, generator), labels
