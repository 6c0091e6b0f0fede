"""Ctrl-C, then the command the run prints: it resumes and finishes, and neither run logs an error.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group (the launcher and every
role process), which is what this test sends."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from miles.launch.run_summary import warning_counts

from .e2e_helpers import QUICKSTART, metrics, miles_argv, wait, wait_for

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]


def run_cli(argv: list[str], out: Path, cwd: Path, cache: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=open(out, "wb"), stderr=subprocess.STDOUT, cwd=cwd,
                            start_new_session=True, env={**os.environ, "MILES_CACHE": str(cache)})


def errors_on_console(text: str) -> list[str]:
    """Console lines of error events (`error [role] event ...`) or tracebacks."""
    return [ln for ln in text.splitlines() if ln.startswith(("error", "Traceback")) or "miles: error" in ln]


def test_ctrl_c_prints_the_resume_command_which_resumes_without_errors(tmp_path: Path, miles_cache: Path) -> None:
    run, cache = tmp_path / "run", miles_cache
    first = tmp_path / "first.out"
    # run.log_json as shipped (auto): the console a user sees. 40 steps: a quick-start step takes
    # ~60 ms here, so with 8 the Ctrl-C had under a second to land before the run ended by itself
    p = run_cli(miles_argv("train", str(QUICKSTART), "--set", "run.dir=run", "--set", "run.warmup_sft_steps=0",
                           "--set", "run.steps=40", "--set", "trainer.checkpoint_interval=2"), first, tmp_path, cache)
    try:
        wait_for(lambda: (run / "checkpoints" / "latest").exists() and len(metrics(run)) >= 3
                 or p.poll() is not None, 240, "the first checkpoint and step 3")
        assert p.poll() is None, first.read_text()[-3000:]
        os.killpg(p.pid, signal.SIGINT)
        assert wait(p, 60) == 130, first.read_text()[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    out = first.read_text()
    assert not errors_on_console(out), out[-3000:]
    assert "warnings/errors in logs" not in out or "error " not in out.split("warnings/errors in logs")[1].split("\n")[0]
    lines = out.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.endswith("Resume with:"))
    cmd = lines[i + 1].strip()
    assert cmd == "miles train --resume run", out[-2000:]  # relative to where the user is (cwd)
    # the printed command, run where it was printed (`miles` is this interpreter's CLI here)
    second = tmp_path / "second.out"
    q = run_cli(miles_argv(*cmd.split()[1:]), second, tmp_path, cache)
    assert wait(q, 300) == 0, second.read_text()[-3000:]
    again = second.read_text()
    assert not errors_on_console(again), again[-3000:]
    assert [r["step"] for r in metrics(run)] == list(range(1, 41))
    # nor in any role's log, over both launches (the summary's warnings/errors row reads these)
    assert not [k for k in warning_counts(run) if k.startswith("error")], warning_counts(run)
