"""The launcher, and the rollout process, run without importing torch.

The engine and trainer processes import torch; the launcher doing so too cost ~1 s of CPU
before any role started, and the rollout process (it tokenizes, routes and scores, never
touching a tensor) another ~1 s while the roles start (2 cores: the quick start's launch ->
first step is ~3 s).
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
from miles.launch import local, report  # noqa: F401
from miles.warmup import sft as warmup
build_parser()
cfg = load_config(MilesConfig, {str(QUICKSTART)!r}, [])
validate_launch(cfg)
warmup._key(cfg)
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


ROLLOUT = f"""
import sys
from miles.core.config import load_config
from miles.core.hooks import resolve_hook
from miles.core.schema import MilesConfig
from miles.launch import role  # noqa: F401
from miles.actors.rollout import RolloutActor  # noqa: F401
from miles.rollout.tokens.tokenizer import load_tokenizer  # noqa: F401
cfg = load_config(MilesConfig, {str(QUICKSTART)!r}, [])
resolve_hook(cfg.rollout.env, "rollout.env")(**cfg.rollout.env_args)
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script", [SCRIPT, ROLLOUT], ids=["launcher", "rollout_role"])
def test_imports_no_torch(script: str) -> None:
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
