"""PNG plots of `miles perftest` results: bandwidth and p50 latency against size, log axes.

One colour per result file (transport/pattern/device): solid = miles, dashed = raw
baseline; each distinct reference limit (memcpy, d2d, pinned h2d) is drawn dotted once. Usable on its own to combine runs:
`python -m miles.perftest.plot OUT.png a.json b.json ...`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from miles.core.errors import ConfigError


def plot(docs: list[dict[str, Any]], out: str | Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib: pip install 'miles[plot]'") from exc
    fig, (ax_bw, ax_lat) = plt.subplots(1, 2, figsize=(13, 5))
    limits_drawn: set[str] = set()
    for i, doc in enumerate(docs):
        rows = doc["rows"]
        if not rows:
            continue
        x = [r["size_bytes"] for r in rows]
        label = f"{rows[0]['transport']} {rows[0]['pattern']} {doc.get('meta', {}).get('device', '')}".strip()
        color = f"C{i % 10}"
        ax_bw.plot(x, [r["gbps"] for r in rows], "-o", ms=3, color=color, label=f"{label} (miles)")
        ax_bw.plot(x, [r["raw_gbps"] for r in rows], "--", color=color, alpha=0.7, label=f"{label} (raw)")
        ax_lat.plot(x, [r["p50_us"] for r in rows], "-o", ms=3, color=color, label=f"{label} (miles)")
        ax_lat.plot(x, [r["raw_p50_us"] for r in rows], "--", color=color, alpha=0.7, label=f"{label} (raw)")
        kind = rows[0]["limit_kind"]
        if kind not in limits_drawn:
            limits_drawn.add(kind)
            ax_bw.plot(x, [r["limit_gbps"] for r in rows], ":", color="gray" if len(limits_drawn) == 1 else "black",
                       label=f"limit ({kind})")
    for ax, ylabel in ((ax_bw, "bandwidth [GB/s]"), (ax_lat, "latency p50 per message [µs]")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size [bytes]")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_bw.legend(fontsize=7)
    fig.suptitle("miles perftest")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m miles.perftest.plot OUT.png RESULT.json [RESULT.json ...]", file=sys.stderr)
        return 2
    plot([json.loads(Path(p).read_text()) for p in argv[1:]], argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
