"""`miles launch --slurm` checks a run as `miles train` does, before anything reaches Slurm.

The Slurm clients on PATH here are recorders: each appends its name and arguments to a file
and answers as sbatch would (a job id). A refused run must leave that file absent and write no
run directory; the same launch with a good config does reach sbatch (so the check can fail).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "examples" / "quickstart.toml")
pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def slurm_recorders(tmp_path: Path) -> tuple[Path, Path]:
    """A bin dir whose sbatch/squeue/scontrol/srun/salloc/scancel record their calls; (bin, record)."""
    bin_dir, record = tmp_path / "bin", tmp_path / "slurm-calls.txt"
    bin_dir.mkdir()
    for name in ("sbatch", "squeue", "scontrol", "srun", "salloc", "scancel"):
        tool = bin_dir / name
        tool.write_text(f'#!/bin/sh\necho "{name} $*" >> {record}\necho 4242\n')
        tool.chmod(0o755)
    return bin_dir, record


def launch(tmp_path: Path, bin_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "", "SLURM_NODELIST": "",
           "SLURM_JOB_NUM_NODES": ""}
    return subprocess.run([sys.executable, "-m", "miles.launch.cli", "launch", *args, "--slurm"],
                          capture_output=True, text=True, timeout=170, cwd=tmp_path, env=env)


@pytest.mark.parametrize(("sets", "word"), [
    (["rollout.env=no_such_module:make_env"], "rollout.env"),
    (["eval.mode=external"], "eval.command"),
    (["model.path=/no/such/model"], "config.json"),
    (["run.time_limit_s=-1"], "run.time_limit_s"),
    (["eval.mode=snapshot"], "eval.mode = 'snapshot'"),
])
def test_a_config_error_is_refused_before_anything_is_submitted(
        tmp_path: Path, slurm_recorders: tuple[Path, Path], sets: list[str], word: str) -> None:
    bin_dir, record = slurm_recorders
    run = tmp_path / "run"
    res = launch(tmp_path, bin_dir, QUICKSTART, "--set", f"run.dir={run}", *[x for s in sets for x in ("--set", s)])
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("miles: error: ConfigError") and word in lines[0], res.stderr
    assert not record.exists(), record.read_text()  # neither sbatch nor squeue nor any Slurm client ran
    assert not run.exists()  # nor was the run directory written


def test_a_used_run_dir_is_refused_and_resume_of_a_run_without_checkpoint_too(
        tmp_path: Path, slurm_recorders: tuple[Path, Path]) -> None:
    bin_dir, record = slurm_recorders
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    res = launch(tmp_path, bin_dir, QUICKSTART, "--set", f"run.dir={run}")
    assert res.returncode == 2 and "is not empty" in res.stderr, res.stderr
    res = launch(tmp_path, bin_dir, "--resume", str(run))
    assert res.returncode == 2 and "config.resolved.json" in res.stderr, res.stderr
    assert not record.exists(), record.read_text()


def test_a_good_config_reaches_sbatch(tmp_path: Path, slurm_recorders: tuple[Path, Path]) -> None:
    bin_dir, record = slurm_recorders
    run = tmp_path / "run"
    res = launch(tmp_path, bin_dir, QUICKSTART, "--set", f"run.dir={run}", "--set", "run.warmup_sft_steps=0")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "submitted job 4242" in res.stdout
    calls = record.read_text().splitlines()
    assert calls == [f"sbatch --parsable {run}/slurm/job.sbatch"], calls
    assert (run / "slurm" / "steps.json").is_file() and (run / "config.resolved.json").is_file()
