"""What a finished (or running) run did, from its files: the end-of-run table and `miles report`.

Reads metrics.jsonl, the final rollout state (ledger totals) and the log files; never the
processes, so it works on any run directory, also one copied from a cluster.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.metrics.sink import read_metrics

REWARD = "rollout/reward_mean"
RESP_LEN = "rollout/response_len_mean"
STALENESS = "rollout/fully_async/avg_staleness"
MISMATCH = "train/train_rollout_logprob_abs_diff"


def series(rows: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:  # steps are ints
    """(step, value) of every row that has a number for `key`."""
    return [(int(r["step"]), float(r[key])) for r in rows
            if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool) and "step" in r]


def quarters(values: list[float]) -> tuple[float, float] | None:
    """Mean of the first and of the last quarter (at least one value each)."""
    if not values:
        return None
    q = max(1, len(values) // 4)
    return sum(values[:q]) / q, sum(values[-q:]) / q


@dataclass
class RunSummary:
    run_dir: Path
    steps: int = 0
    reward: tuple[float, float] | None = None  # first quarter, last quarter
    response_len: tuple[float, float] | None = None
    steps_per_s: float = 0.0  # over the training loop (sum of step times)
    trained_tokens_per_s: float = 0.0
    median_step_s: float = 0.0
    staleness_mean: float | None = None
    staleness_max: float | None = None
    sync_median_s: float | None = None
    sync_total_s: float | None = None
    mismatch_mean: float | None = None
    phases: dict[str, float] = field(default_factory=dict)  # perf/*_s -> median seconds
    ledger: dict[str, Any] = field(default_factory=dict)  # generated/trained/dropped by reason
    warnings: dict[str, int] = field(default_factory=dict)  # event -> count over the role logs
    outputs: list[str] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)  # eval.jsonl rows, by step
    judge: dict[str, float] = field(default_factory=dict)  # the last row's reward_model/* totals (a judge pool)


def read_evals(run_dir: Path) -> list[dict[str, Any]]:
    """The run's evaluations (eval.jsonl), in step order; a failed one is left out."""
    rows = [r for r in read_metrics(run_dir / "eval.jsonl") if "eval/reward_mean" in r]
    return sorted(rows, key=lambda r: int(r.get("step", 0)))


def eval_row(e: dict[str, Any]) -> str:
    acc = e.get("eval/greedy_accuracy", e["eval/reward_mean"])
    k = int(e.get("eval/samples", 0))
    out = f"greedy {acc:.3f}"
    for name in ("strict", "lenient"):
        if f"eval/accuracy_{name}" in e:
            out += f", {name} {e[f'eval/accuracy_{name}']:.3f}"
    if k:
        out += f", avg@{k} {e.get(f'eval/avg_at_{k}', 0.0):.3f}, pass@{k} {e.get(f'eval/pass_at_{k}', 0.0):.3f}"
    if "eval/full/num_prompts" in e:  # every eval row (eval.full_at_ends)
        out += f"; all {int(e['eval/full/num_prompts'])} rows: greedy {e.get('eval/full/greedy_accuracy', 0.0):.3f}"
        for name in ("strict", "lenient"):
            if f"eval/full/accuracy_{name}" in e:
                out += f", {name} {e[f'eval/full/accuracy_{name}']:.3f}"
    return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def ledger_summary(run_dir: Path) -> dict[str, Any]:
    """Groups generated, trained and dropped (by reason), from the final rollout state."""
    p = run_dir / "rollout_final.json"
    if not p.is_file():
        return {}
    try:
        buf = json.loads(p.read_text())["buffer"]
    except (json.JSONDecodeError, KeyError):
        return {}
    led, tot = buf.get("ledger", {}), buf.get("totals", {})
    states: dict[str, int] = {}
    for e in led.get("entries", []):
        states[e["state"]] = states.get(e["state"], 0) + 1
    return {"groups_started": tot.get("groups_started"), "groups_trained": tot.get("groups_trained"),
            "prompts_by_state": states, "retried": led.get("retried", 0),
            "dropped_prompts_by_reason": led.get("dropped_by_reason", {}),
            "drop_events_by_reason": led.get("drop_events", {})}


def warning_counts(run_dir: Path) -> dict[str, int]:
    """`level event` -> count of the warnings and errors in the run's JSON log files."""
    out: dict[str, int] = {}
    for f in sorted((run_dir / "logs").glob("*.log")):
        for ln in f.read_text(errors="replace").splitlines():
            if '"level": "warning"' not in ln and '"level": "error"' not in ln:
                continue
            try:
                ev = json.loads(ln)
            except json.JSONDecodeError:
                continue
            k = f"{ev.get('level')} {ev.get('event')}"
            out[k] = out.get(k, 0) + 1
    return out


def summarize_run(run_dir: str | Path) -> RunSummary:
    run = Path(run_dir)
    rows = read_metrics(run / "metrics.jsonl")
    s = RunSummary(run)
    s.steps = len(rows)
    s.reward = quarters([v for _, v in series(rows, REWARD)])
    s.response_len = quarters([v for _, v in series(rows, RESP_LEN)])
    step_t = [v for _, v in series(rows, "perf/step_time_s")]
    if step_t:
        s.steps_per_s = len(step_t) / sum(step_t) if sum(step_t) > 0 else 0.0
        s.median_step_s = statistics.median(step_t)
        tokens = sum(v for _, v in series(rows, "train/tokens"))
        s.trained_tokens_per_s = tokens / sum(step_t) if sum(step_t) > 0 else 0.0
    st = [v for _, v in series(rows, STALENESS)]
    if st:
        s.staleness_mean = sum(st) / len(st)
        s.staleness_max = max(v for _, v in series(rows, "rollout/fully_async/max_staleness")) \
            if series(rows, "rollout/fully_async/max_staleness") else max(st)
    sync = [v for _, v in series(rows, "perf/sync_s")]
    s.sync_median_s, s.sync_total_s = _median(sync), (sum(sync) if sync else None)
    mm = [v for _, v in series(rows, MISMATCH)]
    s.mismatch_mean = sum(mm) / len(mm) if mm else None
    keys = sorted({k for r in rows for k in r if k.startswith("perf/") and k.endswith("_s")})
    for k in keys:
        med = _median([v for _, v in series(rows, k)])
        if med is not None:
            s.phases[k] = med
    s.ledger = ledger_summary(run)
    if rows and "reward_model/calls" in rows[-1]:
        s.judge = {k.removeprefix("reward_model/"): float(v) for k, v in rows[-1].items()
                   if k.startswith("reward_model/")}
    s.evals = read_evals(run)
    s.warnings = warning_counts(run)
    s.outputs = [str(run / n) for n in ("metrics.jsonl", "report.html", "final_hf", "checkpoints", "logs", "tb")
                 if (run / n).exists()]
    return s


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def format_table(s: RunSummary) -> str:
    """The end-of-run table: one `name | value` row per line, aligned."""
    rows: list[tuple[str, str]] = [("steps", str(s.steps))]
    if s.reward:
        rows.append(("reward (first -> last quarter)",
                     f"{s.reward[0]:.3f} -> {s.reward[1]:.3f} ({s.reward[1] - s.reward[0]:+.3f})"))
    if s.response_len:
        rows.append(("response length [tokens]", f"{s.response_len[0]:.1f} -> {s.response_len[1]:.1f}"))
    rows.append(("throughput", f"{s.steps_per_s:.2f} steps/s, {s.trained_tokens_per_s:.0f} trained tokens/s, "
                               f"median step {s.median_step_s:.3f} s"))
    if s.staleness_mean is not None:
        rows.append(("staleness [versions]", f"mean {s.staleness_mean:.2f}, max {_f(s.staleness_max, '.0f')}"))
    if s.sync_median_s is not None:
        rows.append(("weight sync", f"median {s.sync_median_s * 1e3:.1f} ms, total {_f(s.sync_total_s, '.2f')} s"))
    if s.mismatch_mean is not None:
        rows.append(("|logp train - rollout| (mean)", f"{s.mismatch_mean:.4f}"))
    if s.judge:  # the judge's cost: its calls run beside generation, so as load, not as a phase
        j = s.judge
        fails = ", ".join(f"{k.removeprefix('failed_')} {v:.0f}" for k, v in sorted(j.items())
                          if k.startswith("failed_"))
        rows.append(("judge (reward_model)", f"{j['calls']:.0f} calls, {j['failed']:.0f} failed"
                     + (f" ({fails})" if fails else "") + f", {j['mean_call_s']:.3f} s/call, "
                     f"{j['time_s'] / max(1, s.steps):.2f} judge-s per step"))
    if s.evals:
        first, last = s.evals[0], s.evals[-1]
        rows.append((f"held-out eval, step {int(first.get('step', 0))}", eval_row(first)))
        if len(s.evals) > 1:
            rows.append((f"held-out eval, step {int(last.get('step', 0))}", eval_row(last)))
    led = s.ledger
    if led:
        rows.append(("groups generated / trained", f"{led.get('groups_started')} / {led.get('groups_trained')}"))
        drops = led.get("drop_events_by_reason") or {}
        rows.append(("groups dropped, by reason",
                     ", ".join(f"{k} {v}" for k, v in sorted(drops.items())) or "none"))
        lost = led.get("dropped_prompts_by_reason") or {}
        if lost:
            rows.append(("prompts given up, by reason", ", ".join(f"{k} {v}" for k, v in sorted(lost.items()))))
    if s.warnings:
        rows.append(("warnings/errors in logs", ", ".join(f"{k} x{v}" for k, v in sorted(s.warnings.items()))))
    rows.append(("outputs", str(s.run_dir)))
    for o in s.outputs:
        rows.append(("", "  " + Path(o).name + ("/" if Path(o).is_dir() else "")))
    w = max(len(k) for k, _ in rows)
    line = "-" * (w + 3 + max(len(v) for _, v in rows))
    body = "\n".join(f"{k.ljust(w)} | {v}" if k else f"{''.ljust(w)}   {v}" for k, v in rows)
    return f"{line}\n{body}\n{line}"
