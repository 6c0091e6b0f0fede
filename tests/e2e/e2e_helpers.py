"""Helpers for end-to-end tests: run `miles train` as a real process tree and read its outputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.toml"
# Small and quick: a short warm-up keeps the reward away from 0 and 1, so groups carry signal.
# The quick start's own 30 steps (reward ~0.14 after it, bench/results/quickstart_seeds_cpu.txt):
# the same warm-up hash as the shipped config, so the session trains it once for both.
FAST = ["--set", "run.warmup_sft_steps=30", "--set", "run.log_json=json"]


def miles_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "miles.launch.cli", *args]


def start_run(run_dir: Path, cache: Path, *extra: str) -> subprocess.Popen[bytes]:
    """Start `miles train` in its own session, so a test can kill the whole tree by its PGID."""
    log = open(run_dir.parent / f"{run_dir.name}.launcher.log", "ab")
    return subprocess.Popen(
        miles_argv("train", str(QUICKSTART), "--set", f"run.dir={run_dir}", *FAST, *extra),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "MILES_CACHE": str(cache)},
    )


def resume_run(run_dir: Path, cache: Path, *extra: str) -> subprocess.Popen[bytes]:
    log = open(run_dir.parent / f"{run_dir.name}.launcher.log", "ab")
    return subprocess.Popen(miles_argv("train", "--resume", str(run_dir), *extra), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "MILES_CACHE": str(cache)})


def wait(p: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_tree(p)
        raise


def children(pid: int, needle: str = "") -> list[int]:
    """PIDs of the direct children of `pid` whose command line contains `needle`."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat[1]) == pid and needle in cmd:
            out.append(int(d.name))
    return out


def kill_tree(p: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    """Kill the launcher and every role process it started, all with `sig` at once."""
    pids = children(p.pid) + [p.pid]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
    p.wait(10)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    f = run_dir / "metrics.jsonl"
    return [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()] if f.exists() else []


def wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.2)


def check_ledger(run_dir: Path) -> dict[str, Any]:
    """Every prompt drawn from the data source is in the ledger exactly once; none trained twice."""
    final = json.loads((run_dir / "rollout_final.json").read_text())
    entries = final["buffer"]["ledger"]["entries"]
    ids = [e["prompt_id"] for e in entries]
    assert len(ids) == len(set(ids)), "a prompt appears twice in the ledger"
    prefixes = {i.rsplit("-", 1)[0] for i in ids}
    assert len(prefixes) == 1, prefixes  # one env, ids '<env>-<seed>-<index>'
    prefix = prefixes.pop()
    drawn = {f"{prefix}-{i}" for i in range(final["data"]["position"])}
    assert set(ids) == drawn, f"lost prompts: {sorted(drawn - set(ids))[:5]}"
    for e in entries:
        assert e["state"] in ("pending", "in_flight", "finished", "trained", "dropped")
        if e["state"] == "dropped":
            assert e["reasons"], f"{e['prompt_id']} dropped without a reason"
    return final
