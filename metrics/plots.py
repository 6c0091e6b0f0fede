"""PNG plots of a run's metrics: reward, step time, Δlogp and staleness per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.core.logging import get_logger
from miles.metrics.sink import read_metrics

log = get_logger("miles.plots")

PLOTS = {
    "reward.png": ("rollout/reward_mean", "reward (mean)"),
    "step_time.png": ("perf/step_time_s", "step time [s]"),
    "logprob_diff.png": ("train/train_rollout_logprob_abs_diff", "|logp_train - logp_rollout| (mean)"),
    "staleness.png": ("rollout/fully_async/avg_staleness", "staleness of drawn groups [versions]"),
}


def pyplot() -> Any | None:
    """matplotlib.pyplot on the headless Agg backend, or None (logged) where matplotlib is not
    installed: a run's plots are optional, the run is not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib_unavailable", hint="pip install 'miles[plot]' for PNG plots")
        return None
    return plt


def write_plots(run_dir: str | Path) -> list[Path]:
    """Write one PNG per tracked metric; returns the paths written (none without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return []
    run = Path(run_dir)
    rows = read_metrics(run / "metrics.jsonl")
    out = []
    for fname, (key, label) in PLOTS.items():
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and "step" in r]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        if pts:
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            ax.plot(xs, ys, marker="o", ms=2, lw=0.8, alpha=0.45, label="per step")
            w = max(1, min(10, len(ys) // 5))
            if w > 1:  # a trailing mean shows the trend through per-batch noise
                avg = [sum(ys[max(0, i - w + 1): i + 1]) / (i + 1 - max(0, i - w + 1)) for i in range(len(ys))]
                ax.plot(xs, avg, lw=2.2, label=f"mean of last {w}")
                ax.legend(loc="best", fontsize=8)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.set_title(key)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(run / fname, dpi=100)
        plt.close(fig)
        out.append(run / fname)
    return out
