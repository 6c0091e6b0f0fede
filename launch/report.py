"""`miles report RUN_DIR`: one self-contained HTML page of a run, and a text summary.

The page holds inline SVG plots (held-out evaluation, reward, response length, staleness, step-time phases,
logprob mismatch; the seed's Figure 5 panels), the end-of-run table, the ledger (generated / trained / dropped by
reason), warnings from the logs and the resolved config; nothing is fetched from anywhere.
"""

from __future__ import annotations

import argparse
import html
import json
from pathlib import Path
from typing import Any

from miles.core.errors import ConfigError
from miles.launch.run_summary import (
    MISMATCH,
    RESP_LEN,
    REWARD,
    STALENESS,
    RunSummary,
    format_table,
    read_evals,
    series,
    summarize_run,
)
from miles.launch.svg_plot import line_plot, trailing_mean
from miles.metrics.sink import read_metrics

CSS = """body{font-family:sans-serif;margin:24px;max-width:1340px;color:#222}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
.plots{display:flex;flex-wrap:wrap;gap:12px}.plots figure{margin:0}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
pre{background:#f6f6f6;padding:10px;font-size:12px;overflow:auto;max-height:600px}"""


def _plots(rows: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []

    def add(series_: dict[str, list[tuple[float, float]]], title: str, ylabel: str,
            faint: set[str] | None = None) -> None:
        out.append(line_plot(series_, title=title, ylabel=ylabel, index=len(out), faint=faint))

    reward = series(rows, REWARD)
    w = max(1, min(10, len(reward) // 5))
    add({"per step": reward, f"mean of last {w}": trailing_mean(reward, w)}, "reward", "mean reward",
        faint={"per step"})
    length = {"trained": series(rows, RESP_LEN)}
    if series(rows, "rollout/generated_response_len_mean"):
        length["generated"] = series(rows, "rollout/generated_response_len_mean")
    add(length, "response length", "tokens")
    stale = {"drawn, mean": series(rows, STALENESS),
             "drawn, max": series(rows, "rollout/fully_async/max_staleness")}
    if series(rows, "train/staleness"):
        stale["trained tokens, mean"] = series(rows, "train/staleness")
    add(stale, "staleness", "versions behind")
    phases = sorted({k for r in rows for k in r if k.startswith("perf/") and k.endswith("_s")})
    add({k.removeprefix("perf/"): series(rows, k) for k in phases}, "step-time phases", "seconds")
    add({"mean": series(rows, MISMATCH),
         "max": series(rows, "train/train_rollout_logprob_abs_diff_max")},
        "logprob mismatch |logp_train - logp_rollout|", "nats")
    return out


def _eval_plot(evals: list[dict[str, Any]]) -> list[str]:
    """Held-out accuracy against the training step (step 0 = before RL, when eval.at_start)."""
    if not evals:
        return []
    k = int(evals[-1].get("eval/samples", 0))
    keys = {"greedy accuracy": "eval/greedy_accuracy", "strict": "eval/accuracy_strict",
            "lenient": "eval/accuracy_lenient", "all rows, strict": "eval/full/accuracy_strict",
            "all rows, lenient": "eval/full/accuracy_lenient"}
    if k:
        keys.update({f"avg@{k}": f"eval/avg_at_{k}", f"pass@{k}": f"eval/pass_at_{k}"})
    lines: dict[str, list[tuple[float, float]]] = {
        name: [(int(e["step"]), float(e[key])) for e in evals if key in e] for name, key in keys.items()}
    return [line_plot({n: v for n, v in lines.items() if v}, title="held-out evaluation", ylabel="accuracy",
                      index=8)]


def figure5_panels(rows: list[dict[str, Any]]) -> list[str]:
    """The seed paper's Figure 5 panels of an agentic run: step time, the engine-trainer logprob
    divergence per step, and raw reward with a 9-step moving average."""
    reward = series(rows, REWARD)
    return [
        line_plot({"step time": series(rows, "perf/step_time_s")}, title="step time", ylabel="seconds", index=5),
        line_plot({"mean": series(rows, MISMATCH)}, title="|logp engine - logp trainer| per step",
                  ylabel="nats", index=6),
        line_plot({"raw": reward, "9-step moving average": trailing_mean(reward, 9)}, title="raw reward",
                  ylabel="reward", index=7, faint={"raw"}),
    ]


def _ledger_table(s: RunSummary) -> str:
    led = s.ledger
    if not led:
        return "<p>no rollout_final.json (the run did not finish)</p>"
    rows = [("groups generated", led.get("groups_started")), ("groups trained", led.get("groups_trained")),
            ("prompts retried", led.get("retried"))]
    rows += [(f"groups dropped: {k}", v) for k, v in sorted((led.get("drop_events_by_reason") or {}).items())]
    rows += [(f"prompts given up: {k}", v) for k, v in sorted((led.get("dropped_prompts_by_reason") or {}).items())]
    rows += [(f"prompts {k}", v) for k, v in sorted((led.get("prompts_by_state") or {}).items())]
    return "<table>" + "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
                               for k, v in rows) + "</table>"


def render_html(run_dir: str | Path) -> str:
    run = Path(run_dir)
    rows = read_metrics(run / "metrics.jsonl")
    s = summarize_run(run)
    cfg_toml = run / "config.resolved.toml"
    cfg_text = cfg_toml.read_text() if cfg_toml.is_file() else "(no config.resolved.toml)"
    name = run.name
    cj = run / "config.resolved.json"
    if cj.is_file():
        try:
            name = json.loads(cj.read_text()).get("run", {}).get("name", name)
        except json.JSONDecodeError:
            pass
    figs = "".join(f"<figure>{svg}</figure>" for svg in _eval_plot(read_evals(run)) + _plots(rows))
    fig5 = "".join(f"<figure>{svg}</figure>" for svg in figure5_panels(rows))
    warn = "".join(f"<tr><td>{html.escape(k)}</td><td>{v}</td></tr>" for k, v in sorted(s.warnings.items()))
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>miles run {html.escape(name)}</title>"
            f"<style>{CSS}</style></head><body><h1>miles run: {html.escape(name)}</h1>"
            f"<p>{html.escape(str(run.resolve()))}</p>"
            f"<h2>Summary</h2><pre>{html.escape(format_table(s))}</pre>"
            f"<h2>Plots</h2><div class='plots'>{figs}</div>"
            f"<h2>Step time, logprob divergence, raw reward (the seed's Figure 5 panels)</h2>"
            f"<div class='plots'>{fig5}</div>"
            f"<h2>Ledger</h2>{_ledger_table(s)}"
            f"<h2>Warnings and errors in the logs</h2>"
            f"{'<table>' + warn + '</table>' if warn else '<p>none</p>'}"
            f"<h2>Config</h2><pre>{html.escape(cfg_text)}</pre></body></html>")


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    run = Path(run_dir)
    if not (run / "metrics.jsonl").is_file():
        raise ConfigError(f"miles report: {str(run)!r} has no metrics.jsonl; is it a miles run directory?")
    path = Path(out) if out else run / "report.html"
    path.write_text(render_html(run))
    return path


def cmd_report(args: argparse.Namespace) -> int:
    path = write_report(args.run_dir, args.out or None)
    if args.png:
        from miles.metrics.plots import write_plots

        pngs = write_plots(args.run_dir)
        print(f"PNG plots: {', '.join(str(p) for p in pngs) or 'none (pip install matplotlib)'}")
    print(format_table(summarize_run(args.run_dir)))
    print(f"report: {path}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("report", help="write RUN_DIR/report.html (plots, ledger, config) and print a summary")
    p.add_argument("run_dir")
    p.add_argument("--out", default="", help="HTML path (default RUN_DIR/report.html)")
    p.add_argument("--png", action="store_true", help="also write PNG plots into RUN_DIR (needs matplotlib)")
    p.set_defaults(fn=cmd_report)


def finish_run(run_dir: str | Path, write_plots: Any = None) -> str:
    """After a run: PNG plots (when `write_plots` is given and matplotlib is there), report.html,
    and the end-of-run table naming where everything is."""
    run = Path(run_dir)
    if not (run / "metrics.jsonl").is_file():
        return f"no training steps recorded; logs: {run / 'logs'}"
    if write_plots is not None:
        write_plots(run)
    write_report(run)
    return format_table(summarize_run(run))
