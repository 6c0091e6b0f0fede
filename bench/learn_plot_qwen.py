"""README's first figure: GSM8K on Qwen2.5-Coder-0.5B-Instruct on one GPU, from launched runs.

    python bench/learn_plot_qwen.py --res bench/results/learn_gsm8k_qwen_h100.json \
        [--trl bench/results/learn_vs_trl_qwen_h100.json] [--out docs/img/learn_gsm8k_qwen_h100.png]

Panels: held-out greedy accuracy against training time (strict: the answer in the recipe's format,
the last \\boxed{} or after the last ####, on the first 128 test rows every 25 steps and on all 1,319
at the ends; lenient: the last number, on all 1,319), each
run and TRL; the raw training reward per step with its 9-step moving average; the step time and
|logp engine - logp trainer| per step. The title names the GPU, the commit and the recipe. Input: the
run lines of bench/learn_summary.py (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path
from typing import Any


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def ma(xs: list[float], k: int = 9) -> list[float]:
    return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--res", required=True, help="learn_summary.py output (run lines, then the summary)")
    ap.add_argument("--trl", default="", help="learn_vs_trl result (its summary line has TRL's numbers)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--recipe", default="examples/gsm8k_qwen.toml")
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # strict reads the answer where the recipe's prompt asks for it (rollout/envs/gsm8k.py STRICT)
    fmt = tomllib.loads(Path(a.recipe).read_text())["rollout"]["env_args"].get("answer_format", "hash")
    strict = "strict (last \\boxed{})" if fmt == "boxed" else "strict (after ####)"
    rows = lines(Path(a.res))
    runs = [r for r in rows if r.get("kind") == "run" and not r.get("failed")]
    head = rows[-1]
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.6))
    for r in runs:
        label = f"{r.get('engine_label', r['mode'])} seed {r['seed']}"
        cur = [c for c in r["eval_curve"] if c.get("strict") is not None]
        pts = ax[0].plot([c["loop_s"] / 60 for c in cur], [100 * c["strict"] for c in cur], "o-", alpha=0.5,
                         label=f"{label}: {strict}, first 128 rows")[0]
        full = [c for c in r["eval_curve"] if c.get("full_strict") is not None]
        ax[0].plot([c["loop_s"] / 60 for c in full], [100 * c["full_strict"] for c in full], "s-", ms=8,
                   color=pts.get_color(), label=f"{label}: {strict}, all 1,319 rows")
        ax[0].plot([c["loop_s"] / 60 for c in full], [100 * c["full_lenient"] for c in full], "x:",
                   color=pts.get_color(), label=f"{label}: lenient (last number), all 1,319 rows")
        rew = r["reward_per_step"]
        line = ax[1].plot(range(1, len(rew) + 1), rew, alpha=0.25)[0]
        ax[1].plot(range(1, len(rew) + 1), ma(rew), color=line.get_color(), label=f"{label} (MA9)")
        ax[2].plot(range(1, len(r["step_time_per_step"]) + 1), r["step_time_per_step"], label=f"{label} step s")
        if r.get("logp_abs_diff_per_step"):
            ax2 = ax[2].twinx() if not hasattr(ax[2], "_twin") else ax[2]._twin  # type: ignore[attr-defined]
            ax[2]._twin = ax2  # type: ignore[attr-defined]
            ax2.plot(range(1, len(r["logp_abs_diff_per_step"]) + 1), r["logp_abs_diff_per_step"], ":",
                     color=line.get_color())
            ax2.set_ylabel("|logp engine - logp trainer| (dotted)")
    if a.trl:
        t = lines(Path(a.trl))[-1]
        trl = t.get("trl", t)
        if trl.get("eval_accuracy_after") is not None:
            ax[0].plot([0, trl["train_s"] / 60], [100 * trl["eval_accuracy_before"], 100 * trl["eval_accuracy_after"]],
                       "s--", color="gray", label="TRL GRPOTrainer")
    ax[0].set(xlabel="training time [min]", ylabel="held-out greedy accuracy [%]",
              title="GSM8K test, greedy")
    ax[1].set(xlabel="step", ylabel="training reward", title="raw reward and 9-step moving average")
    ax[2].set(xlabel="step", ylabel="step time [s]", title="step time, logprob gap")
    for x in ax:
        x.grid(alpha=0.3)
    ax[0].legend(fontsize=8)
    ax[1].legend(fontsize=7)
    fig.suptitle(f"Qwen2.5-Coder-0.5B-Instruct, {head.get('hardware', '')}, commit {head.get('commit', '')[:10]}, "
                 f"{a.recipe}", fontsize=10)
    fig.tight_layout()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
