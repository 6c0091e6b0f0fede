"""The learning gate's figure from its result files: GSM8K held-out accuracy against training
time (miles runs and TRL), and the agentic run's raw reward with a 9-step moving average.

    python bench/learn_plot.py [--out bench/results/learn_h200.png]      (needs matplotlib)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RES = Path(__file__).resolve().parent / "results"


def lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RES / "learn_h200.png"))
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = lines(RES / "learn_gsm8k_h200.json")
    ag = lines(RES / "learn_agentic_h200.json")
    trl = lines(RES / "learn_vs_trl_h200.json")[-1]
    head = g[-1]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for r in g[:-1]:
        if r.get("failed"):
            continue
        c = r["eval_curve"]
        lbl = f"miles {r['mode']} seed {r['seed']}"
        ax1.plot([e["loop_s"] for e in c], [e["greedy"] for e in c], marker="o", label=f"{lbl}: greedy")
        ax1.plot([e["loop_s"] for e in c], [e["pass@8"] for e in c], ls=":", alpha=0.6, label=f"{lbl}: pass@8")
    t = trl["trl"]
    ax1.plot([0, t["train_s"]], [t["eval_accuracy_before"], t["eval_accuracy_after"]], marker="s", color="k",
             label="TRL GRPOTrainer: greedy")
    ax1.set_xlabel("training-loop time [s] (evaluations included)")
    ax1.set_ylabel("held-out accuracy (128 test problems)")
    ax1.set_title("GSM8K, <= 2 calculator steps")
    ax1.legend(fontsize=7)
    r = ag[0]
    rew = r["reward_per_step"]
    ma = [sum(rew[max(0, i - 8):i + 1]) / len(rew[max(0, i - 8):i + 1]) for i in range(len(rew))]
    ax2.plot(range(1, len(rew) + 1), rew, alpha=0.3, label="raw reward")
    ax2.plot(range(1, len(ma) + 1), ma, label="9-step moving average")
    ax2.set_xlabel("step")
    ax2.set_ylabel("reward")
    ax2.set_title("agentic: calc tool through sessions, 0 token drift")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{head['model']} on {head['hardware']}, commit {head['commit']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out, dpi=90)
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
