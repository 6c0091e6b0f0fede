"""`miles report`: a self-contained HTML page whose plots render in headless Chromium."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from miles.launch.cli import main
from miles.launch.svg_plot import PLOT_TINTS
from miles.metrics.sink import MetricsSink

pytestmark = pytest.mark.timeout(120)
N_PLOTS = 8  # reward, response length, staleness, step-time phases, logprob mismatch + the 3 Figure 5 panels


def _fake_run(run: Path, steps: int = 60) -> None:
    """A run directory as the launcher leaves it (metrics, final rollout state, config, logs)."""
    sink = MetricsSink(run, tensorboard=False)
    for s in range(1, steps + 1):
        sink.write({"step": s, "rollout/reward_mean": 0.2 + 0.5 * s / steps + 0.05 * math.sin(s),
                    "rollout/response_len_mean": 3 + math.cos(s), "rollout/generated_response_len_mean": 3.2,
                    "rollout/fully_async/avg_staleness": 1 + (s % 3) / 2, "rollout/fully_async/max_staleness": 2,
                    "train/staleness": 1.2, "perf/step_time_s": 0.1 + 0.02 * (s % 5), "perf/sync_s": 0.01,
                    "perf/wait_rollout_s": 0.02 * (s % 2), "train/tokens": 500.0,
                    "train/train_rollout_logprob_abs_diff": 0.05 / s,
                    "train/train_rollout_logprob_abs_diff_max": 0.5 / s})
    sink.close()
    (run / "rollout_final.json").write_text(json.dumps({"buffer": {
        "totals": {"groups_started": 700, "groups_trained": 480},
        "ledger": {"entries": [{"state": "trained"}] * 480, "retried": 9,
                   "dropped_by_reason": {"stale": 4}, "drop_events": {"stale": 200, "aborted": 20}}}}))
    (run / "config.resolved.toml").write_text('[run]\nname = "report-test"\nsteps = 60\n')
    (run / "config.resolved.json").write_text(json.dumps({"run": {"name": "report-test"}}))
    (run / "logs").mkdir()
    (run / "logs" / "engine-0.log").write_text(json.dumps({"event": "event_loop_lag", "level": "warning"}) + "\n")


def test_report_command_writes_a_self_contained_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _fake_run(run)
    assert main(["report", str(run), "--png"]) == 0
    out = capsys.readouterr().out
    assert "reward (first -> last quarter)" in out and "aborted 20, stale 200" in out and "report.html" in out
    if "none (pip install matplotlib)" not in out:
        assert (run / "reward.png").stat().st_size > 1000
    page = (run / "report.html").read_text()
    assert page.count("<svg ") == N_PLOTS
    # nothing to fetch: no scripts, stylesheets or images by URL
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page)
    for text in ("report-test", "groups dropped: aborted", "prompts given up: stale", "steps = 60",
                 "event_loop_lag", "wait_rollout_s", "logprob mismatch"):
        assert text in page, text


def test_report_of_a_directory_without_metrics_fails_clearly(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path)]) != 0
    assert "no metrics.jsonl" in capsys.readouterr().err


def _chromium() -> str | None:
    return next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


def test_plots_render_in_headless_chromium(tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("no headless Chromium (Debian: apt-get install chromium; .ci/run installs it as root)")
    image = pytest.importorskip("PIL.Image")
    run = tmp_path / "run"
    _fake_run(run)
    from miles.launch.report import write_report

    page = write_report(run)
    shot = tmp_path / "report.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--force-color-profile=srgb", "--force-device-scale-factor=1",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,2600",
                    f"--screenshot={shot}", page.resolve().as_uri()],
                   capture_output=True, timeout=90, check=False)
    assert shot.is_file(), "Chromium wrote no screenshot"
    img = image.open(shot).convert("RGB")
    w, h = img.size
    px = img.load()
    boxes: dict[int, list[int]] = {}
    tints = {t: k for k, t in enumerate(PLOT_TINTS[:N_PLOTS])}
    for y in range(0, h, 2):
        for x in range(0, w, 2):
            k = tints.get(px[x, y])
            if k is not None:
                b = boxes.setdefault(k, [x, y, x, y])
                b[0], b[1], b[2], b[3] = min(b[0], x), min(b[1], y), max(b[2], x), max(b[3], y)
    assert sorted(boxes) == list(range(N_PLOTS)), f"plot areas found: {sorted(boxes)}"
    for k, (x0, y0, x1, y1) in boxes.items():
        assert x1 - x0 > 300 and y1 - y0 > 150, f"plot {k} area too small: {(x0, y0, x1, y1)}"
        # drawn data: coloured pixels (lines), not the tint, the grey grid or black text
        coloured = sum(1 for y in range(y0, y1) for x in range(x0, x1)
                       if max(px[x, y]) - min(px[x, y]) > 60)
        assert coloured > 400, f"plot {k} looks blank ({coloured} coloured pixels)"
