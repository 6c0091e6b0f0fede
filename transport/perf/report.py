"""Per-size results of `miles perftest`: statistics, the stdout table, JSON and CSV files.

Every row holds the miles path's figures, the raw baseline's figures for the same
transport, and the on-the-spot reference limit, plus the two ratios (bandwidth of
miles over raw, bandwidth of miles over the limit). Columns are fixed (`COLUMNS`) so
JSON and CSV rows always carry all of them; figures a run cannot have are null/empty.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from miles.transport.perf.sizes import fmt_size


@dataclass
class LatencyStats:
    """One flavor's figures at one size: per-message latency percentiles and throughput."""

    p50_us: float
    p99_us: float
    max_us: float
    gbps: float
    msgs_per_s: float
    messages: int

    @classmethod
    def of(cls, samples_s: list[float], size: int, messages: int, seconds: float) -> LatencyStats:
        if not samples_s or seconds <= 0:
            raise ValueError("no samples measured")
        s = sorted(samples_s)
        return cls(_pct(s, 50) * 1e6, _pct(s, 99) * 1e6, s[-1] * 1e6, size * messages / seconds / 1e9,
                   messages / seconds, messages)


def _pct(sorted_s: list[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: the value was measured)."""
    k = max(0, min(len(sorted_s) - 1, math.ceil(q / 100 * len(sorted_s)) - 1))
    return sorted_s[k]


@dataclass
class ReportRow:
    transport: str
    pattern: str
    device: str
    size_bytes: int
    size: str
    messages: int
    window: int
    p50_us: float
    p99_us: float
    max_us: float
    gbps: float
    msgs_per_s: float
    raw_p50_us: float
    raw_gbps: float
    raw_msgs_per_s: float
    ratio_raw: float
    limit_kind: str
    limit_gbps: float
    ratio_limit: float
    h2d_gbps: float | None
    d2h_gbps: float | None

    @classmethod
    def build(cls, transport: str, pattern: str, device: str, size: int, window: int, miles: LatencyStats,
              raw: LatencyStats, limit_kind: str, limits: dict[str, float]) -> ReportRow:
        lim = limits[limit_kind]
        return cls(transport, pattern, device, size, fmt_size(size), miles.messages, window,
                   miles.p50_us, miles.p99_us, miles.max_us, miles.gbps, miles.msgs_per_s,
                   raw.p50_us, raw.gbps, raw.msgs_per_s, miles.gbps / raw.gbps, limit_kind, lim,
                   miles.gbps / lim, limits.get("h2d"), limits.get("d2h"))


COLUMNS = [f.name for f in fields(ReportRow)]


def table(rows: list[ReportRow]) -> str:
    head = (f"{'size':>8} {'msgs':>6} {'p50 us':>9} {'p99 us':>9} {'max us':>9} {'GB/s':>8} {'msg/s':>9} "
            f"{'raw p50':>9} {'raw GB/s':>9} {'x raw':>6} {'limit':>9} {'x limit':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.size:>8} {r.messages:6d} {r.p50_us:9.1f} {r.p99_us:9.1f} {r.max_us:9.1f} "
                     f"{r.gbps:8.3f} {r.msgs_per_s:9.1f} {r.raw_p50_us:9.1f} {r.raw_gbps:9.3f} {r.ratio_raw:6.2f} "
                     f"{r.limit_gbps:9.2f} {r.ratio_limit:8.4f}")
    return "\n".join(lines)


def _clean(v: Any) -> Any:
    return float(f"{v:.6g}") if isinstance(v, float) else v  # 6 significant digits, tiny values too


def write_json(path: str | Path, meta: dict[str, Any], rows: list[ReportRow]) -> None:
    doc = {"meta": meta, "columns": COLUMNS, "rows": [{k: _clean(v) for k, v in asdict(r).items()} for r in rows]}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def write_csv(path: str | Path, rows: list[ReportRow]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else _clean(v)) for k, v in asdict(r).items()})
