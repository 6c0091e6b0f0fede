"""Plots beside a diffusion run: the reward curve and sample grids at the first and last step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from miles.metrics.plots import pyplot


def grid(images: np.ndarray, cols: int = 8, pad: int = 1) -> np.ndarray:
    """Images [N, 3, H, W] in [-1, 1] -> one uint8 RGB mosaic [rows*(H+pad), cols*(W+pad), 3]."""
    n, _, h, w = images.shape
    rows = (n + cols - 1) // cols
    out = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, 3), 40, np.uint8)
    img = ((np.clip(images, -1, 1) + 1) * 127.5).round().astype(np.uint8).transpose(0, 2, 3, 1)
    for i in range(n):
        r, c = divmod(i, cols)
        out[pad + r * (h + pad):pad + r * (h + pad) + h, pad + c * (w + pad):pad + c * (w + pad) + w] = img[i]
    return out


def write_diffusion_plots(run_dir: str | Path, rows: list[dict[str, Any]], eval_rewards: list[tuple[int, float]],
                          first: np.ndarray | None, last: np.ndarray | None, title: str = "") -> list[Path]:
    """reward_curve.png (rollout and evaluation reward per step), samples_first.png and
    samples_last.png (the fixed-seed evaluation batch); none without matplotlib."""
    plt = pyplot()
    if plt is None:
        return []
    run = Path(run_dir)
    out = []
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    xs = [r["step"] for r in rows]
    ax.plot(xs, [r["rollout/reward_mean"] for r in rows], lw=0.8, alpha=0.6, label="rollout batch reward")
    if eval_rewards:
        ax.plot([s for s, _ in eval_rewards], [v for _, v in eval_rewards], marker="o", lw=2,
                label="eval reward (64 fixed seeds)")
    ax.set_xlabel("step (weight version)")
    ax.set_ylabel("reward")
    vals = [r["rollout/reward_mean"] for r in rows] + [v for _, v in eval_rewards]
    if vals and min(vals) >= 0 and max(vals) <= 1:
        ax.set_ylim(0, 1)
    ax.set_title(title or "diffusion GRPO")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(run / "reward_curve.png", dpi=100)
    plt.close(fig)
    out.append(run / "reward_curve.png")
    for name, imgs in (("samples_first.png", first), ("samples_last.png", last)):
        if imgs is None:
            continue
        fig, ax = plt.subplots(figsize=(4, 4))
        ax.imshow(grid(imgs), interpolation="nearest")
        ax.set_axis_off()
        ax.set_title(name.removesuffix(".png").replace("_", " "))
        fig.tight_layout()
        fig.savefig(run / name, dpi=100)
        plt.close(fig)
        out.append(run / name)
    return out
