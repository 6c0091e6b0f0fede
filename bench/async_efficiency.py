"""Sample efficiency on the quick-start task: sync vs fully_async, reward against trained samples
and against wall time, several seeds each (the `efficiency` part of bench/async_vs_sync.py).

Each run is a full launched `miles train` of examples/quickstart.toml (warm-up SFT cached per
seed, then RL) with the roles pinned as in the throughput part; only `buffer.mode`, the seed
and the number of steps differ. Reward = `rollout/reward_mean`, the mean reward of the batch
the trainer took at that step (under fully_async sampled by weights up to max_staleness
versions older). Trained samples = steps x batch_groups x n_samples_per_prompt; wall time =
the sum of step times. Curves are saved as one PNG and the raw per-step rows as JSON.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from miles.core.config import load_config
from miles.core.schema import MilesConfig

REPO = Path(__file__).resolve().parent.parent
SMOOTH = 5  # steps of the moving average drawn and used for "steps to reach"


def quickstart_config(run_dir: Path, mode: str, seed: int, steps: int, schedule: str = "deadline",
                      extra: list[str] | None = None) -> MilesConfig:
    """The quick start with this run's settings; `extra` are further KEY=VALUE overrides."""
    sets = {"run.dir": str(run_dir), "run.steps": str(steps), "run.seed": str(seed), "run.progress": "false",
            "run.log_level": "error", "buffer.mode": mode, "buffer.schedule": schedule}
    return load_config(MilesConfig, REPO / "examples" / "quickstart.toml",
                       [f"{k}={v}" for k, v in sets.items()] + list(extra or []))


def run_summary(rows: list[dict[str, Any]], cfg: MilesConfig) -> dict[str, Any]:
    per_step = cfg.buffer.batch_groups * cfg.rollout.n_samples_per_prompt
    rewards = [float(r["rollout/reward_mean"]) for r in rows]
    wall, t = [], 0.0
    for r in rows:
        t += float(r["perf/step_time_s"])
        wall.append(round(t, 3))
    gen = float(rows[-1].get("rollout/generated_samples", 0.0))
    stale = sum(float(r.get("rollout/fully_async/stale_groups_filtered", 0.0)) for r in rows)
    return {"reward": rewards, "samples": [per_step * (i + 1) for i in range(len(rows))], "wall_s": wall,
            "generated_samples": gen, "stale_completions": stale * cfg.rollout.n_samples_per_prompt,
            "stale_share": stale * cfg.rollout.n_samples_per_prompt / gen if gen else 0.0,
            "len_ratio": float(rows[-1].get("rollout/fully_async/len_ratio", 1.0)),
            "untrained_share": float(rows[-1].get("rollout/fully_async/untrained_share", 0.0))}


def smooth(xs: list[float], k: int = SMOOTH) -> list[float]:
    return [statistics.fmean(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]


def compare(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Final reward (mean of the last quarter of steps) per seed, and steps to reach 90% of sync's."""
    def final(r: dict[str, Any]) -> float:
        xs = r["reward"]
        return statistics.fmean(xs[-max(1, len(xs) // 4):])

    out: dict[str, Any] = {m: {"final_reward": [round(final(r), 4) for r in rs]} for m, rs in runs.items()}
    target = 0.9 * statistics.fmean(out["sync"]["final_reward"])
    for m, rs in runs.items():
        reach = [next((i + 1 for i, x in enumerate(smooth(r["reward"])) if x >= target), None) for r in rs]
        out[m] |= {"steps_to_target": reach,
                   "wall_s_to_target": [r["wall_s"][s - 1] if s else None for r, s in zip(rs, reach, strict=True)],
                   "wall_s_total": [r["wall_s"][-1] for r in rs],
                   "stale_share": [round(r["stale_share"], 4) for r in rs],
                   "len_ratio": [round(r["len_ratio"], 3) for r in rs]}
    out["target_reward"] = round(target, 4)
    return out


def plot(runs: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (mode, rs), color in zip(runs.items(), ["tab:blue", "tab:orange", "tab:green"], strict=False):
        n = min(len(r["reward"]) for r in rs)
        curves = [smooth(r["reward"][:n]) for r in rs]
        mean = [statistics.fmean(c[i] for c in curves) for i in range(n)]
        lo = [min(c[i] for c in curves) for i in range(n)]
        hi = [max(c[i] for c in curves) for i in range(n)]
        for ax, key in zip(axes, ["samples", "wall_s"], strict=True):
            x = [statistics.fmean(r[key][i] for r in rs) for i in range(n)]
            ax.plot(x, mean, color=color, label=f"{mode} (mean of {len(rs)} seeds)" if len(rs) > 1 else
                    f"{mode} (1 seed)")
            ax.fill_between(x, lo, hi, color=color, alpha=0.2)
    axes[0].set_xlabel("trained samples")
    axes[1].set_xlabel("wall time: sum of step times (s)")
    for ax in axes:
        ax.set_ylabel(f"batch reward ({SMOOTH}-step moving average)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(runs: dict[str, list[dict[str, Any]]], summary: dict[str, Any], out: Path, title: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"title": title, "summary": summary, "runs": runs}, indent=1))
    plot(runs, out.with_suffix(".png"), title)
