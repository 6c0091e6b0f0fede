"""Every wait of the rollout and trainer roles has its own option with a unit and a doc, and no
wait borrows another option's value times a factor (issue 36)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from miles.core.config import load_config
from miles.core.errors import ConfigError
from miles.core.schema import MilesConfig

pytestmark = pytest.mark.timeout(30)
ROOT = Path(__file__).resolve().parents[2]
WAITS = {"trainer": ("batch_timeout_s", "pause_timeout_s"), "rollout": ("generate_timeout_s",),
         "sync": ("step_timeout_s", "catchup_poll_s", "health_timeout_s")}


def test_each_wait_is_a_documented_option_in_seconds(tmp_path: Path) -> None:
    cfg = MilesConfig()
    for section, names in WAITS.items():
        fields = {f.name: f for f in dataclasses.fields(getattr(cfg, section))}
        for name in names:
            meta = fields[name].metadata
            assert meta["unit"] == "s" and len(meta["doc"]) > 20, f"{section}.{name}"
            assert getattr(getattr(cfg, section), name) > 0
            p = tmp_path / "c.toml"
            p.write_text(f"[{section}]\n{name} = 0.0\n")
            with pytest.raises(ConfigError, match=name):
                load_config(MilesConfig, str(p))


def test_no_role_waits_a_multiple_of_another_option() -> None:
    borrowed = re.compile(r"timeout=[^\n]*_s \* \d|_s \* \d+\)?\s*$|or self\.cfg\.[a-z_.]*_s \*")
    for rel in ("actors/rollout.py", "actors/trainer.py", "actors/engine_yield.py", "actors/engine_link.py"):
        for i, line in enumerate((ROOT / rel).read_text().splitlines(), 1):
            assert not borrowed.search(line), f"{rel}:{i}: {line.strip()}"
