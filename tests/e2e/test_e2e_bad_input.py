"""A wrong config gives one clear error line naming the cause, and a non-zero exit, before any process starts."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from .e2e_helpers import QUICKSTART, miles_argv

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--set", "rollout.env=no_such_pkg:make_env"], "rollout.env"),
        (["--set", "trainer.correction.types=[]"], "trainer.correction.types is empty"),
        (["--set", "model.path=/definitely/not/here"], "model.path"),
        (["--set", "buffer.mode=async"], "buffer.mode"),
        (["--set", "trainer.true_on_policy=true"], "engine.batch_invariant"),
        (["--set", "trainer.optim.lrr=1"], "unknown config key 'trainer.optim.lrr'"),
        (["--set", "trainer.lora.rank=4", "--set", "sync.transport=disk_delta", "--set", "sync.delta_dir=/tmp/x"],
         "trainer.lora.rank > 0: sync.transport = 'disk_delta'"),
    ],
)
def test_bad_config_one_line_error(args: list[str], needle: str, tmp_path: Path) -> None:
    # its own run dir: not the quick start's default one, which the README's first command fills
    p = subprocess.run(miles_argv("train", str(QUICKSTART), "--set", f"run.dir={tmp_path / 'run'}", *args),
                       capture_output=True, text=True, timeout=100)
    assert p.returncode != 0
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("miles: error:") and needle in err[0], p.stderr


def test_missing_config_file() -> None:
    p = subprocess.run(miles_argv("train", "/no/such/config.toml"), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "does not exist" in p.stderr


def test_a_config_error_comes_before_the_run_dir_check(tmp_path: Path) -> None:
    """A bad option and a used run dir: the first (and only) error names the option."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")  # an earlier run's file
    p = subprocess.run(miles_argv("train", str(QUICKSTART), "--set", f"run.dir={run}",
                                  "--set", "model.path=/definitely/not/here"),
                       capture_output=True, text=True, timeout=100)
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(err) == 1 and "model.path" in err[0] and "not empty" not in err[0], p.stderr
