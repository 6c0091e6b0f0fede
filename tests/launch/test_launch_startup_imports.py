"""The launcher reaches the point of starting the roles without importing torch.

Each role process imports torch itself; the launcher doing so too cost ~1 s of CPU before
any role started (2 cores: the whole quick start's launch -> first step is ~4 s).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.toml"

SCRIPT = f"""
import sys
from miles.launch.cli import build_parser
from miles.core.config import load_config
from miles.core.schema import MilesConfig
from miles.launch.validate import validate_launch
from miles.launch import local, report, warmup  # noqa: F401
build_parser()
cfg = load_config(MilesConfig, {str(QUICKSTART)!r}, [])
validate_launch(cfg)
warmup._key(cfg)
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


@pytest.mark.timeout(60)
def test_launcher_path_imports_no_torch() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
