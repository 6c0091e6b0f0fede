"""Line plots as inline SVG text: no plotting library, so a report renders anywhere.

Each plot's drawing area has its own background tint (`PLOT_TINTS`), which lets a test
find it in a browser screenshot and check that something was drawn on it.
"""

from __future__ import annotations

import html
import math

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
# the drawing-area tint of plot k (k mod len): near-white, distinct, never a line colour
PLOT_TINTS = [(252, 252, 246), (246, 252, 252), (252, 246, 252), (246, 252, 246), (252, 249, 242),
              (242, 249, 252), (249, 242, 252), (252, 242, 249), (246, 246, 252)]

Series = list[tuple[float, float]]


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About `n` round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks, t = [], start
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    if ticks[-1] < hi:
        ticks.append(ticks[-1] + step)
    return ticks


def _label(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.1e}"
    return f"{v:.4g}"


def trailing_mean(pts: Series, window: int) -> Series:
    out, acc = [], 0.0
    for i, (x, y) in enumerate(pts):
        acc += y
        if i >= window:
            acc -= pts[i - window][1]
        out.append((x, acc / min(i + 1, window)))
    return out


def line_plot(series: dict[str, Series], *, title: str, ylabel: str, index: int = 0,
              width: int = 640, height: int = 280, faint: set[str] | None = None) -> str:
    """An SVG element: one polyline per named series (x = step), axes, grid, legend.
    Series named in `faint` are drawn thin and translucent (raw values under a mean)."""
    faint = faint or set()
    left, right, top, bottom = 62, 12, 28, 40
    pw, ph = width - left - right, height - top - bottom
    pts = [p for s in series.values() for p in s if math.isfinite(p[1])]
    tint = "rgb({},{},{})".format(*PLOT_TINTS[index % len(PLOT_TINTS)])
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(title)}">',
           f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
           f'<rect class="plot-area" x="{left}" y="{top}" width="{pw}" height="{ph}" fill="{tint}"/>',
           f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13" '
           f'font-family="sans-serif">{html.escape(title)}</text>']
    if not pts:
        out.append(f'<text x="{width / 2}" y="{top + ph / 2}" text-anchor="middle" font-size="12" '
                   'font-family="sans-serif" fill="#666">no data</text></svg>')
        return "".join(out)
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    xt, yt = nice_ticks(min(xs), max(xs)), nice_ticks(min(ys), max(ys))
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]

    def sx(x: float) -> float:
        return left + (x - x0) / ((x1 - x0) or 1) * pw

    def sy(y: float) -> float:
        return top + ph - (y - y0) / ((y1 - y0) or 1) * ph

    for t in yt:
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#ddd"/>'
                   f'<text x="{left - 5}" y="{sy(t) + 4:.1f}" text-anchor="end" font-size="10" '
                   f'font-family="sans-serif">{_label(t)}</text>')
    for t in xt:
        out.append(f'<line x1="{sx(t):.1f}" x2="{sx(t):.1f}" y1="{top}" y2="{top + ph}" stroke="#ddd"/>'
                   f'<text x="{sx(t):.1f}" y="{top + ph + 14}" text-anchor="middle" font-size="10" '
                   f'font-family="sans-serif">{_label(t)}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle" font-size="11" '
               'font-family="sans-serif">step</text>'
               f'<text x="12" y="{top + ph / 2}" text-anchor="middle" font-size="11" font-family="sans-serif" '
               f'transform="rotate(-90 12 {top + ph / 2})">{html.escape(ylabel)}</text>')
    for k, (name, s) in enumerate(series.items()):
        color = COLORS[k % len(COLORS)]
        good = [(x, y) for x, y in s if math.isfinite(y)]
        if not good:
            continue
        style = 'stroke-width="1" stroke-opacity="0.45"' if name in faint else 'stroke-width="2"'
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in good)
        if len(good) == 1:
            x, y = good[0]
            out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>')
        else:
            out.append(f'<polyline fill="none" stroke="{color}" {style} points="{path}"/>')
        ly = top + 12 + 14 * k
        out.append(f'<line x1="{left + pw - 150}" x2="{left + pw - 132}" y1="{ly - 4}" y2="{ly - 4}" '
                   f'stroke="{color}" stroke-width="2"/><text x="{left + pw - 128}" y="{ly}" font-size="10" '
                   f'font-family="sans-serif">{html.escape(name)}</text>')
    out.append("</svg>")
    return "".join(out)
