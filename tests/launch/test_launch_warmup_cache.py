"""The warm-up cache keeps no half-written checkpoint: Ctrl-C mid-warm-up removes its temp dir,
and a temp dir of a launcher that no longer runs is removed by the next warm-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
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
    lines: list[str] = []
    assert p.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(iter(p.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        # The signal goes once the first SFT step has printed: inside the training loop for certain
        # (a fixed sleep after the temp dir appeared was, on a loaded 2-core CI runner, sometimes not).
        deadline = time.monotonic() + 90
        while not any(ln.startswith("warm-up 1/") for ln in list(lines)):
            assert p.poll() is None and time.monotonic() < deadline, f"the warm-up did not start: {''.join(lines)}"
            time.sleep(0.05)
        assert list(cache.glob("*.tmp*/tokenizer.json")), "the warm-up writes into a temp dir"
        p.send_signal(signal.SIGINT)
        p.wait(timeout=30)
        reader.join(5)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
    log = tmp_path / "run" / "logs" / "launcher.log"
    why = (f"rc={p.returncode}\noutput:\n{''.join(lines)}\ncache: {sorted(x.name for x in cache.iterdir())}\n"
           f"launcher.log:\n{log.read_text()[-3000:] if log.is_file() else '(none)'}")
    assert p.returncode == 130, why
    assert list(cache.iterdir()) == [], why  # neither a temp dir nor a checkpoint


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
