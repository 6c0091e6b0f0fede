"""`miles diffusion` on a console that is not a terminal (a pipe, CI): readable lines, one per
step, and the JSON events in the run's log file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


def test_diffusion_prints_readable_step_lines_not_json(tmp_path: Path) -> None:
    run = tmp_path / "run"
    sets = [f"run.dir={run}", "run.steps=2", "run.eval_every=1", "run.threads=1", "model.pretrain_steps=3",
            "model.channels=8", "model.emb_dim=16", "sampler.steps=4", "reward.fn=miles.diffusion.rewards:red_left",
            "n_samples=4", "buffer.capacity=16", "buffer.batch_groups=2"]
    p = subprocess.run([sys.executable, "-m", "miles.launch.cli", "diffusion", *[x for s in sets for x in ("--set", s)]],
                       capture_output=True, text=True, timeout=110, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    console = (p.stdout + p.stderr).splitlines()
    assert p.returncode == 0, "\n".join(console[-30:])
    assert not [ln for ln in console if ln.lstrip().startswith("{")], console
    steps = [ln for ln in console if "diffusion_step:" in ln]
    assert [ln.split("step=")[1].split()[0] for ln in steps] == ["1", "2"], console
    events = [json.loads(ln) for ln in (run / "logs" / "diffusion.log").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "diffusion_step"] == [1, 2]
