"""The warm-up cache keeps no half-written checkpoint: Ctrl-C mid-warm-up removes its temp dir,
and a temp dir of a launcher that no longer runs is removed by the next warm-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.core.config import load_config
from miles.core.schema import MilesConfig
from miles.warmup.sft import ensure_initial_checkpoint

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def test_ctrl_c_during_warm_up_leaves_no_temp_dir(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    p = subprocess.Popen([sys.executable, "-m", "miles.launch.cli", "train", str(ROOT / "examples" / "quickstart.toml"),
                          "--set", f"run.dir={tmp_path / 'run'}", "--set", "run.warmup_sft_steps=1000000"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "MILES_CACHE": str(cache)})
    try:
        deadline = time.monotonic() + 90
        while not list(cache.glob("*.tmp*")) or not list(cache.glob("*.tmp*/tokenizer.json")):
            assert p.poll() is None and time.monotonic() < deadline, "the warm-up did not start"
            time.sleep(0.05)
        time.sleep(0.5)  # inside the training loop
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
    assert p.returncode == 130, out
    assert list(cache.iterdir()) == [], out  # neither a temp dir nor a checkpoint


def test_an_orphaned_temp_dir_is_removed_by_the_next_warm_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_CACHE", str(tmp_path))
    cfg = load_config(MilesConfig, str(ROOT / "examples" / "quickstart.toml"), ["run.warmup_sft_steps=0"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = Path(ensure_initial_checkpoint(cfg))
    orphan = out.with_name(out.name + f".tmp{dead.pid}")  # what a launcher killed by SIGKILL leaves
    orphan.mkdir()
    live = out.with_name(out.name + ".tmp1")  # of a process that runs (pid 1): kept
    live.mkdir()
    import shutil

    shutil.rmtree(out)
    ensure_initial_checkpoint(cfg)
    assert not orphan.exists() and live.exists() and (out / "config.json").is_file()
