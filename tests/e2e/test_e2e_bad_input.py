"""A wrong config gives one clear error line naming the cause, and a non-zero exit, before any process starts."""

from __future__ import annotations

import subprocess

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
def test_bad_config_one_line_error(args: list[str], needle: str) -> None:
    p = subprocess.run(miles_argv("train", str(QUICKSTART), *args), capture_output=True, text=True,
                       timeout=100)
    assert p.returncode != 0
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("miles: error:") and needle in err[0], p.stderr


def test_missing_config_file() -> None:
    p = subprocess.run(miles_argv("train", "/no/such/config.toml"), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "does not exist" in p.stderr
