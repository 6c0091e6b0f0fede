"""metrics.jsonl after a kill -9: readable, and a resumed run appends whole records; atomic state writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.core.files import atomic_write_text
from miles.metrics.sink import MetricsSink, read_metrics

pytestmark = pytest.mark.timeout(60)


def test_torn_last_line_is_skipped_and_a_resumed_run_does_not_append_onto_it(tmp_path: Path) -> None:
    sink = MetricsSink(tmp_path, tensorboard=False)
    for step in range(3):
        sink.write({"step": step, "loss": 1.0 / (step + 1)})
    sink.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lo')  # what kill -9 mid-write leaves
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2]
    resumed = MetricsSink(tmp_path, tensorboard=False)
    resumed.write({"step": 3, "loss": 0.25})
    resumed.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.endswith("\n") and '"lo' not in text.replace('"loss"', "")
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    assert all(json.loads(ln) for ln in text.splitlines())  # every line whole


def test_atomic_write_never_leaves_a_torn_file(tmp_path: Path) -> None:
    """A writer killed at random moments: the file always holds one whole version."""
    target = tmp_path / "state.json"
    atomic_write_text(target, json.dumps({"n": -1, "pad": "x" * 100_000}))
    code = (
        "import json, sys\n"
        "from miles.core.files import atomic_write_text\n"
        "i = 0\n"
        "while True:\n"
        f"    atomic_write_text({str(target)!r}, json.dumps({{'n': i, 'pad': 'x' * 100_000}}))\n"
        "    i += 1\n"
    )
    for _ in range(5):
        atomic_write_text(target, json.dumps({"n": -1, "pad": "x" * 100_000}))  # each writer counts from 0
        p = subprocess.Popen([sys.executable, "-c", code])
        try:  # killed once this writer has replaced the file a few times (mid-write, most likely)
            deadline = time.monotonic() + 60
            while json.loads(target.read_text())["n"] < 3:
                assert p.poll() is None and time.monotonic() < deadline, "the writer never wrote"
                time.sleep(0.01)
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        d = json.loads(target.read_text())
        assert len(d["pad"]) == 100_000
    leftovers = [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    assert len(leftovers) <= 5  # a kill between create and rename may leave one; the target is whole


def test_tensorboard_gets_every_scalar_of_every_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = MetricsSink(tmp_path)
    for step in range(1, 4):
        sink.write({"step": step, "train/loss": 1.0 / step, "rollout/reward_mean": 0.1 * step, "note": "x",
                    "flag": True})
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["rollout/reward_mean", "train/loss"]
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([1.0, 0.5, 1 / 3])
    assert [e.value for e in acc.Scalars("rollout/reward_mean")] == pytest.approx([0.1, 0.2, 0.3])
