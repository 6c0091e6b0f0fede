"""One run per run directory (metrics/run_dir.py): a fresh run into a used directory is refused,
a resume drops the records past its checkpoint (metrics, eval, TensorBoard), and resuming a
finished run launches nothing. The CLI cases run `miles train` as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.core.config import load_config, to_dict
from miles.core.schema import MilesConfig
from miles.metrics.run_dir import checkpoint_step, truncate_step_records
from miles.metrics.sink import MetricsSink, read_metrics

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.toml"
pytestmark = pytest.mark.timeout(60)


def miles(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "miles.launch.cli", *args], capture_output=True, text=True,
                          timeout=50, cwd=cwd)


def test_fresh_run_into_a_used_dir_is_refused_naming_both_ways_on(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    p = miles("train", str(QUICKSTART), "--set", f"run.dir={run}", cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    (line,) = p.stderr.splitlines()  # one line
    # the resume command as it can be pasted where the user is (cwd=tmp_path)
    assert "is not empty" in line and "train --resume run`" in line and "run.dir=NEW_DIR" in line
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing written
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_slurm_launch_into_a_used_dir_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.resolved.json").write_text("{}")
    p = miles("launch", str(QUICKSTART), "--slurm", "--set", f"run.dir={run}", cwd=tmp_path)
    assert p.returncode == 2 and "is not empty" in p.stderr and "--resume" in p.stderr, p.stderr


def test_truncation_drops_rows_past_the_checkpoint_step(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(1, 9))
                                            + '{"step": 9, "x"')  # the killed run's torn last write
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (2, 4, 6)))
    step = checkpoint_step(tmp_path / "checkpoints" / "step_000004")
    assert step == 4
    assert truncate_step_records(tmp_path, step) == {"metrics.jsonl": 5, "eval.jsonl": 1}
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [json.loads(ln)["step"] for ln in (tmp_path / "eval.jsonl").read_text().splitlines()] == [2, 4]
    assert truncate_step_records(tmp_path, step) == {}  # idempotent: the sink may cut again


def test_resumed_sink_repeats_no_step_in_metrics_or_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsSink(tmp_path)
    for s in range(1, 9):
        first.write({"step": s, "loss": float(s)})
    first.close()
    resumed = MetricsSink(tmp_path, resume_step=4)  # the checkpoint was at step 4
    for s in range(5, 7):
        resumed.write({"step": s, "loss": 100.0 + s})
    resumed.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0), (6, 106.0)]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0),
                                                                (5, 105.0), (6, 106.0)]


def test_resuming_a_finished_run_says_so_and_launches_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(MilesConfig, str(QUICKSTART), ["run.steps=3", f"run.dir={run}"])
    (run / "config.resolved.json").write_text(json.dumps(to_dict(cfg)))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    (run / "rollout_final.json").write_text("{}")
    p = miles("train", "--resume", str(run), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "already finished (step 3 of run.steps=3)" in p.stdout and "--set run.steps=N" in p.stdout
    assert not (run / "logs").exists()  # no launcher, no role
    assert (run / "metrics.jsonl").read_text().count("\n") == 3
    # more steps asked for: it is a resume again (and this run has no checkpoint to resume from)
    p = miles("train", "--resume", str(run), "--set", "run.steps=5", cwd=tmp_path)
    assert p.returncode == 2 and "no checkpoint yet" in p.stderr, p.stdout + p.stderr
