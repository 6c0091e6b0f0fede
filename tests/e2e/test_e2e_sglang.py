"""`miles train` with engine.type = "sglang", launched as a user would, on CPU: the engines launch
tests/sglang_sim (a SIMULATION of SGLang 0.5.17's HTTP wire that computes with miles' own CPU
model; not SGLang) through `engine.sglang_python`, exactly as they launch the real server.
A real RL run: the quick start (its tiny model with head_dim 64, which SGLang's rope kernel
takes) trains for a few steps, weights are committed into the servers every version.

These fail if the traps of issue 35 come back: a default pause mode the server cannot do (the
run would be refused or its first sync would fail), a server that fails at start restarted in
a loop, a crashed server not brought back on the committed version, two engines on one port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from miles.core.ports import group_port

from .e2e_helpers import QUICKSTART, check_ledger, kill_tree, metrics, miles_argv, wait, wait_for

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

SIM_PYTHON = Path(__file__).parents[1] / "sglang_sim" / "python"
LAUNCH_MARK = "# miles launch: "


def free_port_block(n: int) -> int:
    """A port p with p .. p+n-1 free now (engines listen on sglang_port + index)."""
    for _ in range(50):
        p = group_port()  # below the ephemeral range: no connection takes it meanwhile
        if p + n > 65535:
            continue
        free = True
        for q in range(p + 1, p + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", q))
                except OSError:
                    free = False
        if free:
            return p
    raise RuntimeError("no free block of ports")


def start(tmp: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], Path, Path]:
    run, console = tmp / "run", tmp / "console.txt"
    argv = miles_argv(
        "train", str(QUICKSTART), "--set", f"run.dir={run}", "--set", "run.warmup_sft_steps=30",
        "--set", "engine.type=sglang", "--set", "model.overrides.head_dim=64",
        "--set", f"engine.sglang_python={SIM_PYTHON}", "--set", f"engine.sglang_stage_dir={tmp / 'stage'}",
        "--set", "engine.sglang_startup_timeout_s=120", "--set", "engine.sglang_return_routed_experts=true",
        *extra)
    with console.open("wb") as f:
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "MILES_CACHE": str(tmp.parent / "cache"),
                                  "MILES_SGLANG_SIM_PYTHON": sys.executable, **(env or {})})
    return p, run, console


def server_pids(port: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "sglang.launch_server" in cmd and f"--port {port} " in cmd:
                out.append(int(d.name))
    return out


def launches(stage: Path) -> int:
    log = stage / "server.log"
    return log.read_text(errors="replace").count(LAUNCH_MARK) if log.exists() else 0


def test_sglang_defaults_train_and_survive_a_server_crash(tmp_path: Path) -> None:
    port = free_port_block(1)
    # the server holds the second weight update while this file exists: the kill below lands while
    # the run still needs the server (a 4-step run could otherwise end before the kill)
    hold = tmp_path / "hold-updates"
    hold.touch()
    p, run, console = start(tmp_path, "--set", "run.steps=4", "--set", f"engine.sglang_port={port}",
                            env={"MILES_SGLANG_SIM_HOLD_UPDATES": str(hold)})
    try:
        wait_for(lambda: len(metrics(run)) >= 1 or p.poll() is not None, 300, "the first step")
        assert p.poll() is None, console.read_text()[-3000:]
        [pid] = server_pids(port)
        os.kill(pid, signal.SIGKILL)  # a server that had served: restarted on the committed version
        hold.unlink()
        assert wait(p, 360) == 0, console.read_text()[-3000:]
    finally:
        if p.poll() is None:
            kill_tree(p)
    cfg = json.loads((run / "config.resolved.json").read_text())
    # the one pause option resolved to what SGLang can do, and every sync used it
    assert cfg["sync"]["pause_mode"] == "retract" and cfg["engine"]["dtype"] == "bfloat16"
    assert "pause_mode" not in cfg["engine"]
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["version"] for r in rows] == [1, 2, 3, 4]
    assert all(r["sync/bytes"] > 0 and r["perf/sync_s"] > 0 for r in rows)
    check_ledger(run)
    assert launches(tmp_path / "stage") == 2  # the first start and the one restart
    engine_log = (run / "logs" / "engine-0.log").read_text()
    assert "sglang_server_restart" in engine_log and "sglang_engine_ready" in engine_log
    assert not server_pids(port), "the run left its server behind"


def test_two_engines_in_memory_updates(tmp_path: Path) -> None:
    port = free_port_block(2)
    p, run, console = start(tmp_path, "--set", "run.steps=3", "--set", "engine.num_engines=2",
                            "--set", f"engine.sglang_port={port}", "--set", "engine.sglang_weight_update=tensor")
    try:
        assert wait(p, 360) == 0, console.read_text()[-3000:]
    finally:
        if p.poll() is None:
            kill_tree(p)
    cfg = json.loads((run / "config.resolved.json").read_text())
    assert cfg["engine"]["sglang_mem_fraction"] * 2 <= 0.45 + 1e-9  # split with the trainer's share
    rows = metrics(run)
    assert [r["version"] for r in rows] == [1, 2, 3]
    for i in (0, 1):  # each engine launched its own server, on its own port, updated in memory
        text = (run / "logs" / f"engine-{i}.log").read_text()
        assert f"http://127.0.0.1:{port + i}" in text and '"update": "tensor"' in text
        assert '"event": "engine_weights_committed"' in text


def test_server_failing_at_start_is_shown_and_not_restarted(tmp_path: Path) -> None:
    port = free_port_block(1)
    p, run, console = start(tmp_path, "--set", "run.steps=2", "--set", f"engine.sglang_port={port}",
                            env={"MILES_SGLANG_SIM_FAIL_AT_START":
                                 "AssertionError: save kv cache is not supported for fallback_rotary_embedding."})
    try:
        rc = wait(p, 240)
    finally:
        if p.poll() is None:
            kill_tree(p)
    out = console.read_text()
    assert rc != 0, out[-3000:]
    assert "save kv cache is not supported for fallback_rotary_embedding" in out  # the server's own line
    assert launches(tmp_path / "stage") == 1, "a server that failed at start was started again"
    assert not metrics(run)  # and it ended by itself: wait() above fails a run that hangs


def test_a_server_that_cannot_come_back_stops_the_run_with_its_cause(tmp_path: Path) -> None:
    port = free_port_block(1)
    p, run, console = start(tmp_path, "--set", "run.steps=50", "--set", f"engine.sglang_port={port}",
                            "--set", "engine.sglang_max_restarts=0")
    try:
        wait_for(lambda: len(metrics(run)) >= 1 or p.poll() is not None, 300, "the first step")
        assert p.poll() is None, console.read_text()[-3000:]
        [pid] = server_pids(port)
        os.kill(pid, signal.SIGKILL)
        rc = wait(p, 200)
    finally:
        if p.poll() is None:
            kill_tree(p)
    out = console.read_text()
    # the cause on the console (from the engine role's exit or the rollout's last error, whichever
    # the launcher sees first), and no further start
    assert rc != 0 and "has been restarted 0 times" in out, out[-3000:]
    assert launches(tmp_path / "stage") == 1
