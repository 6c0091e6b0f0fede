"""The one progress line per training step, with its ETA: printed by the launcher's console
(from metrics.jsonl) and by trainer rank 0 where no console follows the run (`run.progress`)."""

from __future__ import annotations

from typing import Any


def fmt_eta(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def eval_part(rec: dict[str, Any]) -> str:
    """`eval@40 greedy 0.125 strict 0.109 lenient 0.156 avg@8 0.094 pass@8 0.312 all(1319) strict 0.27
    lenient 0.30` from an evaluation's metrics: strict/lenient where the env scores answers both
    ways (GSM8K), all(N) where the evaluation covered every one of the N eval rows."""
    acc = rec.get("eval/greedy_accuracy", rec["eval/reward_mean"])
    out = f"eval@{int(rec.get('eval/step', rec.get('step', 0)))} greedy {acc:.3f}"
    for name in ("strict", "lenient"):
        if f"eval/accuracy_{name}" in rec:
            out += f" {name} {rec[f'eval/accuracy_{name}']:.3f}"
    k = int(rec.get("eval/samples", 0))
    if k:
        out += f" avg@{k} {rec.get(f'eval/avg_at_{k}', 0.0):.3f} pass@{k} {rec.get(f'eval/pass_at_{k}', 0.0):.3f}"
    if "eval/full/num_prompts" in rec:
        out += f" all({int(rec['eval/full/num_prompts'])})"
        scored = [n for n in ("strict", "lenient") if f"eval/full/accuracy_{n}" in rec]
        for name in scored:
            out += f" {name} {rec[f'eval/full/accuracy_{name}']:.3f}"
        if not scored:
            out += f" greedy {rec.get('eval/full/greedy_accuracy', 0.0):.3f}"
    return out


def progress_line(rec: dict[str, Any], total: int, rewards: list[float], elapsed: float, done: int) -> str:
    """`step  12/120  10% | reward 0.39 (avg10 0.35) | ... | ETA 0:12` for one metrics row:
    learning, staleness and bias, mismatch, speed, where the time went, and the ETA from `done`
    steps in `elapsed` seconds."""
    step = int(rec.get("step", 0))
    avg = rewards[-10:]
    parts = [f"step {step:{len(str(total))}d}/{total} {100 * step // max(total, 1):3d}%"]
    if "rollout/reward_mean" in rec:
        parts.append(f"reward {rec['rollout/reward_mean']:.3f} (avg10 {sum(avg) / len(avg):.3f})")
    if "rollout/fully_async/avg_staleness" in rec:
        parts.append(f"stale {rec['rollout/fully_async/avg_staleness']:.2f}")
    if "rollout/fully_async/len_ratio" in rec:
        parts.append(f"len_ratio {rec['rollout/fully_async/len_ratio']:.2f}")
    if "train/train_rollout_logprob_abs_diff" in rec:
        parts.append(f"Δlogp {rec['train/train_rollout_logprob_abs_diff']:.4f}")
    if "train/tokens_per_s" in rec:
        parts.append(f"tok/s {rec['train/tokens_per_s']:.0f}")
    if "eval/reward_mean" in rec:
        parts.append(eval_part(rec))
    if "perf/step_time_s" in rec:
        train = f" (train {rec['perf/train_s']:.2f}s)" if "perf/train_s" in rec else ""
        parts.append(f"step {rec['perf/step_time_s']:.2f}s{train}")
    if "perf/sync_s" in rec:
        parts.append(f"sync {rec['perf/sync_s'] * 1e3:.0f}ms")
    rate = done / elapsed if elapsed > 0 and done else 0.0
    parts.append(f"ETA {fmt_eta((total - step) / rate)}" if rate else "ETA -")
    return " | ".join(parts)


class Progress:
    """What the line needs across steps: the rewards so far and the rate since the first step
    seen (start-up excluded; one step's own time stands in for the rate until there are two)."""

    def __init__(self, total_steps: int) -> None:
        self.total = total_steps
        self.rewards: list[float] = []
        self.started: float | None = None
        self.first_step = 0
        self._steps_s = 0.0  # perf/step_time_s of the steps after the first

    def line(self, rec: dict[str, Any], now: float) -> str:
        """The progress line of metrics row `rec`, which landed at monotonic time `now`."""
        if "rollout/reward_mean" in rec:
            self.rewards.append(float(rec["rollout/reward_mean"]))
        step = int(rec.get("step", 0))
        step_s = float(rec.get("perf/step_time_s", 0.0))
        if self.started is None:
            self.started, self.first_step = now, step
            elapsed, done = step_s, 1
        else:
            # Rows arrive in bursts (one poll reads every row written since the last): the wall
            # time since the first row can be ~0 for the next ones, which made the rate infinite
            # and the ETA 0:00 on step 2. The steps' own times bound the elapsed time from below.
            self._steps_s += step_s
            elapsed, done = max(now - self.started, self._steps_s), step - self.first_step
        return progress_line(rec, self.total, self.rewards or [0.0], elapsed, done)
