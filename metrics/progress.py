"""The one progress line per training step, with its ETA: printed by the launcher's console
(from metrics.jsonl) and by trainer rank 0 where no console follows the run (`run.progress`)."""

from __future__ import annotations

import math
from typing import Any


def num(rec: dict[str, Any], key: str, spec: str, scale: float = 1.0) -> str:
    """`rec[key] * scale` formatted with `spec`, or `n/a` where the value is missing, None (a NaN
    or inf becomes None in metrics.jsonl) or not finite: one odd metric never stops the console."""
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return "n/a"
    return format(v * scale, spec)


def fmt_eta(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def eval_part(rec: dict[str, Any]) -> str:
    """`eval@40 greedy 0.125 strict 0.109 lenient 0.156 avg@8 0.094 pass@8 0.312 all(1319) strict 0.27
    lenient 0.30` from an evaluation's metrics: strict/lenient where the env scores answers both
    ways (GSM8K), all(N) where the evaluation covered every one of the N eval rows; `n/a` for a
    value that is missing or was not finite."""
    acc = "eval/greedy_accuracy" if "eval/greedy_accuracy" in rec else "eval/reward_mean"
    at = rec.get("eval/step")  # 0 is the step-0 evaluation, not a missing value
    at = rec.get("step") if at is None else at
    out = f"eval@{int(at or 0)} greedy {num(rec, acc, '.3f')}"
    for name in ("strict", "lenient"):
        if f"eval/accuracy_{name}" in rec:
            out += f" {name} {num(rec, f'eval/accuracy_{name}', '.3f')}"
    k = int(rec.get("eval/samples") or 0)
    if k:
        out += f" avg@{k} {num(rec, f'eval/avg_at_{k}', '.3f')} pass@{k} {num(rec, f'eval/pass_at_{k}', '.3f')}"
    if rec.get("eval/full/num_prompts"):
        out += f" all({int(rec['eval/full/num_prompts'])})"
        scored = [n for n in ("strict", "lenient") if f"eval/full/accuracy_{n}" in rec]
        for name in scored:
            out += f" {name} {num(rec, f'eval/full/accuracy_{name}', '.3f')}"
        if not scored:
            out += f" greedy {num(rec, 'eval/full/greedy_accuracy', '.3f')}"
    return out


def progress_line(rec: dict[str, Any], total: int, rewards: list[float], elapsed: float, done: int) -> str:
    """`step  12/120  10% | reward 0.39 (avg10 0.35) | ... | ETA 0:12` for one metrics row:
    learning, staleness and bias, mismatch, speed, where the time went, and the ETA from `done`
    steps in `elapsed` seconds."""
    step = int(rec.get("step") or 0)
    avg = [r for r in rewards[-10:] if math.isfinite(r)] or [0.0]
    parts = [f"step {step:{len(str(total))}d}/{total} {100 * step // max(total, 1):3d}%"]
    if "rollout/reward_mean" in rec:
        parts.append(f"reward {num(rec, 'rollout/reward_mean', '.3f')} (avg10 {sum(avg) / len(avg):.3f})")
    if "rollout/fully_async/avg_staleness" in rec:
        parts.append(f"stale {num(rec, 'rollout/fully_async/avg_staleness', '.2f')}")
    if "rollout/fully_async/len_ratio" in rec:
        parts.append(f"len_ratio {num(rec, 'rollout/fully_async/len_ratio', '.2f')}")
    if "train/train_rollout_logprob_abs_diff" in rec:
        parts.append(f"Δlogp {num(rec, 'train/train_rollout_logprob_abs_diff', '.4f')}")
    if rec.get("train/skipped_nonfinite"):
        parts.append(f"SKIPPED {num(rec, 'train/skipped_nonfinite', '.0f')} non-finite update(s)")
    if "train/tokens_per_s" in rec:
        parts.append(f"tok/s {num(rec, 'train/tokens_per_s', '.0f')}")
    if "eval/reward_mean" in rec:
        parts.append(eval_part(rec))
    if "perf/step_time_s" in rec:
        train = f" (train {num(rec, 'perf/train_s', '.2f')}s)" if "perf/train_s" in rec else ""
        parts.append(f"step {num(rec, 'perf/step_time_s', '.2f')}s{train}")
    if "perf/sync_s" in rec:
        ms = num(rec, "perf/sync_s", ".0f", 1e3)
        parts.append(f"sync {ms}ms" if ms != "n/a" else "sync n/a")
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
        if isinstance(rec.get("rollout/reward_mean"), int | float):
            self.rewards.append(float(rec["rollout/reward_mean"]))
        step = int(rec.get("step") or 0)
        step_s = rec.get("perf/step_time_s")
        step_s = float(step_s) if isinstance(step_s, int | float) and math.isfinite(step_s) else 0.0
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
