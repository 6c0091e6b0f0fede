"""GSM8K's held-out evaluation in a launched CPU run: every test row at step 0 and at the end,
the fixed subset with avg@k / pass@k, strict and lenient accuracy, and the console line.

The tiny preset (random weights, the repo's own tokenizer) on GSM8K-format rows kept in the repo
(tests/data/gsm8k_like): what it answers is noise, so the test checks what was evaluated and
reported, not how well; the scorers themselves are tested on real answers in
tests/rollout/test_rollout_gsm8k_scoring.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from .e2e_helpers import ROOT, kill_tree, miles_argv

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]
DATA = ROOT / "tests" / "data" / "gsm8k_like"
TEST_ROWS = len((DATA / "test.jsonl").read_text().splitlines())
CONFIG = f"""
[run]
steps = 2
warmup_sft_steps = 0
time_limit_s = 0

[model]
arch = "qwen3_moe"

[engine]
max_batch_size = 16
max_seq_len = 400

[rollout]
env = "miles.rollout.envs.gsm8k:make_env"
env_args = {{ path = "{DATA / 'train.jsonl'}", eval_path = "{DATA / 'test.jsonl'}" }}
n_samples_per_prompt = 2
max_new_tokens = 6

[buffer]
mode = "fully_async"
capacity = 8
batch_groups = 2

[trainer]
micro_batch_tokens = 4096

[eval]
mode = "shared"
at_start = true
at_end = true
every_steps = 1
full_at_ends = true
num_prompts = 2
samples = 2
max_new_tokens = 6
env_args = {{ split = "eval" }}
"""


def test_full_eval_at_both_ends_with_strict_and_lenient(tmp_path: Path) -> None:
    run, console = tmp_path / "run", tmp_path / "console.txt"
    cfg = tmp_path / "gsm8k_eval.toml"
    cfg.write_text(CONFIG)
    argv = miles_argv("train", str(cfg), "--set", f"run.dir={run}")
    with console.open("wb") as f:
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "MILES_CACHE": str(tmp_path / "cache")})
        try:
            assert p.wait(380) == 0, console.read_text()[-3000:]
        finally:
            if p.poll() is None:
                kill_tree(p)
    evals = [json.loads(ln) for ln in (run / "eval.jsonl").read_text().splitlines()]
    # every_steps = 1: subset evaluations after steps 1 and 2, and the full ones at 0 and at 2
    # (the last step's every_steps evaluation does not stand in for the full one)
    full = [e for e in evals if "eval/full/num_prompts" in e]
    assert [e["step"] for e in full] == [0, 2], evals
    subset = sorted(e["step"] for e in evals if e not in full)
    # step 2's every_steps evaluation is skipped (and counted) when step 1's still runs: a run never
    # queues evaluations behind each other; that depends on the machine's speed, the count does not
    skipped = max(float(r.get("eval/skipped", 0.0)) for r in (json.loads(ln) for ln in
                  (run / "metrics.jsonl").read_text().splitlines()))
    assert subset == [1, 2] or (subset == [1] and skipped == 1.0), (subset, skipped)
    for e in evals:
        assert "eval/failed" not in e, e
        assert e["eval/num_prompts"] == 2 and e["eval/samples"] == 2
        for key in ("eval/accuracy_strict", "eval/accuracy_lenient", "eval/avg_at_2", "eval/pass_at_2"):
            assert 0.0 <= e[key] <= 1.0, (key, e)
    for e in full:
        assert e["eval/full/num_prompts"] == TEST_ROWS
        for key in ("eval/full/accuracy_strict", "eval/full/accuracy_lenient", "eval/full/greedy_accuracy"):
            assert 0.0 <= e[key] <= 1.0, (key, e)
    text = console.read_text()
    step_lines = [ln for ln in text.splitlines() if ln.startswith("step ")]
    assert any("eval@0 greedy" in ln and " strict " in ln and f"all({TEST_ROWS}) strict" in ln for ln in step_lines), \
        text[-3000:]
    assert f"all {TEST_ROWS} rows: greedy" in text  # the end-of-run table
