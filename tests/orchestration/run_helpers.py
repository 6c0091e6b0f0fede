"""Helpers of the orchestration tests: run `miles train` as real processes, read what it wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.toml"

# A tiny, short run: untrained policy (no warm-up), 4 samples per prompt, 2 groups a step.
SMALL = {
    "run.steps": "3", "run.warmup_sft_steps": "0", "run.progress": "false", "run.log_level": "warning",
    "rollout.n_samples_per_prompt": "4", "rollout.max_new_tokens": "6",
    "buffer.batch_groups": "2", "buffer.capacity": "8", "buffer.max_staleness": "1",
}

# Long-tailed per-prompt budgets (rollout/envs/long_tail.py): groups finish far out of order,
# so batches are often collected piecemeal while other groups still generate.
LONG_TAIL = {  # env_args replaced whole: the quick start's own (arithmetic's) do not fit long_tail
    "rollout.env": "miles.rollout.envs.long_tail:make_env",
    "rollout.env_args": "{median_tokens = 4, sigma = 1.0, max_tokens = 24}",
}


def train(run_dir: Path, cache: Path, overrides: dict[str, str], timeout: float = 120.0) -> None:
    """Run `miles train` on the quick start with SMALL + overrides; raise with the logs on failure."""
    sets = [a for k, v in {**SMALL, **overrides, "run.dir": str(run_dir)}.items() for a in ("--set", f"{k}={v}")]
    env = {**os.environ, "MILES_CACHE": str(cache)}
    proc = subprocess.Popen([sys.executable, "-m", "miles.launch.cli", "train", str(QUICKSTART), *sets],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher forwards it to the roles it started
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"miles train timed out:\n{out.decode()[-4000:]}\n{role_logs(run_dir)}") from None
    if proc.returncode != 0:
        raise AssertionError(f"miles train exited {proc.returncode}:\n{out.decode()[-4000:]}\n{role_logs(run_dir)}")


def role_logs(run_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((run_dir / "logs").glob("*.log")))


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def rollout_state(run_dir: Path) -> dict[str, Any]:
    """What the rollout actor wrote on stop: {"buffer": {"ledger", "prompts", "totals"}, "data": ...}."""
    return json.loads((run_dir / "rollout_state.json").read_text())
