"""A role's crash reaches the console with its exception's last line, and a failure at start is
not restarted (launch/supervision.py); the launcher runs as a real `miles train` process tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.core.errors import StartupError
from miles.launch.supervision import RestartPolicy, crash_report, exception_line
from miles.models.presets import tiny_config
from miles.rollout.tokens.tiny_tokenizer import save_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.toml"


@pytest.mark.timeout(150)
def test_missing_weights_fail_once_with_the_cause_on_the_console(tmp_path: Path, miles_cache: Path) -> None:
    """A model dir with config.json and a tokenizer but no weights: the engine's load error
    is shown on the launcher's console and the engine is not started again."""
    model = tmp_path / "model"
    save_tiny_tokenizer(model)
    (model / "config.json").write_text(json.dumps(tiny_config("qwen3", vocab_size=256)))
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "miles.launch.cli", "train", str(QUICKSTART), "--set",
                        f"model.path={model}", "--set", f"run.dir={run}", "--set", "run.steps=2"],
                       capture_output=True, text=True, timeout=140, cwd=tmp_path,
                       env={**os.environ, "MILES_CACHE": str(miles_cache)})
    console = p.stdout + p.stderr
    assert p.returncode == 1, console
    (line,) = [ln for ln in console.splitlines() if "role_failed_at_start" in ln]
    assert line.startswith("error [engine]") and "CheckpointError" in line, console
    assert "has neither model.safetensors" in line  # the exception's own words
    assert "Traceback" not in console and "{" not in line  # readable, not the raw stream
    events = [json.loads(ln) for ln in (run / "logs" / "launcher.log").read_text().splitlines()]
    starts = [e for e in events if e["event"] == "role_started" and e["role"] == "engine"]
    assert len(starts) == 1 and not any(e["event"] == "role_crashed_restarting" for e in events)
    # the role's own report, which the launcher read
    role_events = [json.loads(ln) for ln in (run / "logs" / "engine-0.log").read_text().splitlines()
                   if ln.startswith("{")]
    (failed,) = [e for e in role_events if e["event"] == "role_failed"]
    assert failed["started"] is False and failed["error"].startswith("CheckpointError: ")


def test_restart_policy() -> None:
    pol = RestartPolicy(max_restarts=2)
    assert pol.decide(served=False, fatal=False, restarts=0).why == "role_failed_at_start"
    assert pol.decide(served=True, fatal=True, restarts=0).why == "role_failed_fatal"
    assert pol.decide(served=True, fatal=False, restarts=0).action == "restart"
    assert pol.decide(served=True, fatal=False, restarts=1).action == "restart"
    assert pol.decide(served=True, fatal=False, restarts=2).why == "role_gave_up"


def test_crash_report_reads_this_incarnation_only(tmp_path: Path) -> None:
    log = tmp_path / "engine-0.log"
    log.write_text(json.dumps({"event": "role_failed", "level": "error", "error": "OldError: before",
                               "fatal": True}) + "\n")
    start = log.stat().st_size
    assert crash_report(log, 0).reason == "OldError: before" and crash_report(log, 0).fatal
    assert crash_report(log, start).reason == ""  # killed by a signal: nothing of its own
    # died before logging was configured: the traceback's last line
    with log.open("a") as f:
        f.write('Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
                "ModuleNotFoundError: No module named 'sglang'\n")
    assert crash_report(log, start).reason == "ModuleNotFoundError: No module named 'sglang'"


@pytest.mark.timeout(60)
def test_a_segfault_is_reported_with_where_it_happened(tmp_path: Path) -> None:
    """A real process that dies of SIGSEGV in native code, with faulthandler on as a role has it
    (launch/role.py): its log holds no Python exception, and the report names the signal and the
    innermost Python frame of the crashing thread."""
    log = tmp_path / "engine-0.log"
    log.write_text(json.dumps({"event": "host_ready", "level": "info"}) + "\n")
    script = tmp_path / "boom.py"
    script.write_text("import ctypes, faulthandler\nfaulthandler.enable(all_threads=True)\n"
                      "def push_weights():\n    ctypes.string_at(0)\npush_weights()\n")
    with log.open("ab") as f:
        proc = subprocess.run([sys.executable, str(script)], stderr=f, timeout=30)
    assert proc.returncode == -11
    reason = crash_report(log, 0).reason
    assert reason.startswith("Fatal Python error: Segmentation fault at "), reason
    # the two innermost frames: where the signal hit (inside ctypes), then the caller
    assert "ctypes/__init__.py:" in reason and " in string_at < " in reason, reason
    assert reason.endswith(f"{tmp_path.name}/boom.py:4 in push_weights"), reason


def test_exception_line_keeps_the_tail_of_a_long_message() -> None:
    server_line = "ValueError: the server's own error line"
    line = exception_line(StartupError("sglang server exited at start: " + "x" * 2000 + "\n" + server_line))
    assert line.startswith("StartupError: sglang server exited at start") and line.endswith(server_line)
    assert len(line) <= 300 and "\n" not in line
