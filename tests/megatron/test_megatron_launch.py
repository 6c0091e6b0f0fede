"""`miles train` with trainer.backend='megatron' where megatron-core cannot run (this CPU
machine: Python < 3.12, megatron-core not installed, or no CUDA) fails fast, before any
process starts, with one error line naming why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from miles.trainer.megatron.available import unavailable_reason

WHY = unavailable_reason()
QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.toml"
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(WHY is None, reason="megatron-core can run here: nothing to refuse"),
]


def test_miles_train_megatron_refused_with_one_line(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "miles.launch.cli", "train", str(QUICKSTART),
            "--set", f"run.dir={tmp_path / 'run'}", "--set", "trainer.backend=megatron"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=100)
    assert p.returncode == 2, p.stderr
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(err) == 1, p.stderr
    assert err[0].startswith("miles: error: ConfigError: trainer.backend='megatron' cannot run: ")
    assert WHY is not None and WHY in err[0]
    assert not (tmp_path / "run").exists()  # nothing was started


def test_fsdp_backend_passes_the_same_launch_check() -> None:
    from miles.core.config import load_config
    from miles.core.schema import MilesConfig
    from miles.launch.validate import validate_launch

    validate_launch(load_config(MilesConfig, str(QUICKSTART), []))
