"""A small CNN shape classifier (circle / square / triangle), trained in the recipe on the
same procedural shapes and used as a reward model ("is this a circle").

Trained on clean shapes plus lightly noised copies, so it gives graded, not saturated,
answers on imperfect samples. Saved and loaded with safetensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from miles.core.errors import ConfigError
from miles.diffusion.data import NUM_CLASSES, shape_batch


class ShapeClassifier(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, width, 3, padding=1)
        self.c2 = nn.Conv2d(width, 2 * width, 3, padding=1, stride=2)
        self.c3 = nn.Conv2d(2 * width, 2 * width, 3, padding=1, stride=2)
        self.head = nn.Linear(2 * width, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [N, classes] of images [N, 3, H, W] in [-1, 1]."""
        h = F.silu(self.c1(x.float()))
        h = F.silu(self.c2(h))
        h = F.silu(self.c3(h))
        return self.head(h.mean((2, 3)))


def train_classifier(steps: int = 400, batch: int = 128, seed: int = 0, size: int = 16) -> tuple[ShapeClassifier, float]:
    """A trained classifier and its accuracy on 1024 fresh held-out shapes."""
    g = torch.Generator().manual_seed(seed + 7)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 7)
        clf = ShapeClassifier()
    opt = torch.optim.Adam(clf.parameters(), lr=3e-3)
    for _ in range(steps):
        x, y = shape_batch(batch, size, g)
        noise = torch.rand(batch, 1, 1, 1, generator=g) * 0.3
        x = x + noise * torch.randn(x.shape, generator=g)
        loss = F.cross_entropy(clf(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        x, y = shape_batch(1024, size, g)
        acc = float((clf(x).argmax(1) == y).float().mean())
    return clf, acc


def save_classifier(clf: ShapeClassifier, path: str | Path) -> None:
    save_file({k: v.contiguous() for k, v in clf.state_dict().items()}, str(path))


def load_classifier(path: str | Path) -> ShapeClassifier:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"reward classifier {str(p)!r} does not exist (train it with the recipe first)")
    clf = ShapeClassifier()
    clf.load_state_dict(load_file(str(p)))
    clf.eval()
    return clf
