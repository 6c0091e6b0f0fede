"""The quick start end to end: real processes, real engine, trainer and weight sync on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from .e2e_helpers import check_ledger, metrics, start_run, wait

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

REQUIRED = ["step", "rollout/reward_mean", "train/train_rollout_logprob_abs_diff", "perf/step_time_s",
            "rollout/fully_async/queue_size", "rollout/fully_async/aborted_groups_filtered",
            "rollout/fully_async/stale_groups_filtered", "rollout/fully_async/avg_staleness",
            "rollout/fully_async/max_staleness", "rollout/fully_async/buffer_avg_staleness",
            "rollout/fully_async/buffer_max_staleness"]


def test_quickstart_writes_every_output(tmp_path: Path) -> None:
    run = tmp_path / "run"
    p = start_run(run, tmp_path / "cache", "--set", "run.steps=4")
    assert wait(p, 280) == 0, (tmp_path / "run.launcher.log").read_text()[-3000:]
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
    # The first step trains on data from the very weights it starts with, replayed with R3:
    # the trainer's logprobs equal the engine's.
    assert rows[0]["train/train_rollout_logprob_abs_diff"] < 1e-4
    for png in ("reward.png", "step_time.png", "logprob_diff.png", "staleness.png"):
        assert (run / png).stat().st_size > 1000
    assert list((run / "tb").glob("events.*"))
    check_ledger(run)
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "final_hf")
    assert model.config.model_type == "qwen3_moe"
