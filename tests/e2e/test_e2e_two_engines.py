"""Two engines, launched for real: groups are routed whole, and a killed engine loses no prompt.

- Routing: every trajectory of a group carries the group's routing key, so a GRPO group's
  8 samples go to one engine, which prefills the prompt once and copies it for the other
  seven (engine.share_prompts). Read from the engines' own counters in rollout_final.json:
  each engine prefilled at most one prompt in 8 requests. Routing per trajectory (the old
  key `group/sample`) alternates a group over both engines: each then prefills one prompt
  in 4, and this fails.
- Deaths: kill -9 one engine mid-run, while both generate long responses. The rollout learns of the death, routes nothing to
  it, and sends the requests lost with it to the survivor without failing their
  trajectories; training goes on while it is down, and it is used again once restarted.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from .e2e_helpers import check_ledger, children, kill_tree, metrics, start_run, wait, wait_for

pytestmark = [pytest.mark.timeout(300)]

TWO = ["--set", "engine.num_engines=2", "--set", "run.warmup_sft_steps=0", "--set", "run.progress=false"]
N = 8  # the quick start's samples per prompt
# Engines that never idle: every response sampled to a long budget (24-48 tokens, stop tokens
# ignored), and generation never waits for the trainer (no staleness bound, so no admission
# bound, and no limit on finished groups waiting). A kill then always catches requests in flight.
BUSY = ["--set", "rollout.env=miles.rollout.envs.long_tail:make_env",
        "--set", "rollout.env_args={median_tokens = 36, sigma = 0.3, min_tokens = 24, max_tokens = 48, "
                 "ignore_stop = true}",
        "--set", "buffer.max_staleness=-1", "--set", "buffer.max_waiting=100000"]


def _final(run: Path) -> dict[str, Any]:
    return json.loads((run / "rollout_final.json").read_text())


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_groups_go_whole_to_one_engine_and_each_prompt_is_prefilled_once(tmp_path: Path, mode: str, miles_cache: Path) -> None:
    run, cache = tmp_path / "run", miles_cache
    p = start_run(run, cache, *TWO, "--set", "run.steps=6", "--set", f"buffer.mode={mode}")
    assert wait(p, 240) == 0, (tmp_path / "run.launcher.log").read_text()[-3000:]
    final = _final(run)
    routing = final["routing"]
    assert routing["groups_routed"] >= 6 * 8  # 6 steps of 8 groups, each released when it ended
    assert routing["groups_split"] == 0, routing
    assert routing["keys_held"] <= 16  # only the groups still in flight at the end keep a key
    assert metrics(run)[-1]["rollout/groups_split"] == 0.0
    for name, st in final["engines"].items():
        assert st["requests"] > 0, (name, st)  # both engines served
        prefilled = st["prompt_tokens"] - st["shared_prompt_tokens"] - st["prefix_cached_tokens"]
        # one prefill per group of 8 (identical prompts of two groups may share too: <=)
        assert 0 < N * prefilled <= st["prompt_tokens"], (name, st)
    check_ledger(run)


def test_a_killed_engine_loses_no_prompt_and_the_survivor_keeps_generating(tmp_path: Path, miles_cache: Path) -> None:
    run, cache = tmp_path / "run", miles_cache
    # 24 steps: the kill comes after step 3 and the restarted engine is back some 3-10 steps later
    # (a new role process and a catch-up push), which leaves it steps to generate again
    p = start_run(run, cache, *TWO, "--set", "run.steps=24", *BUSY)
    try:
        wait_for(lambda: len(metrics(run)) >= 3, 240, "step 3")
        engines = children(p.pid, "miles.launch.role engine")
        assert len(engines) == 2
        victim = next(pid for pid in engines if "--index 1" in Path(f"/proc/{pid}/cmdline").read_bytes()
                      .replace(b"\0", b" ").decode())
        os.kill(victim, signal.SIGKILL)
        assert wait(p, 240) == 0, (tmp_path / "run.launcher.log").read_text()[-3000:]
    finally:
        if p.poll() is None:
            kill_tree(p)
    assert "role_crashed_restarting" in (tmp_path / "run.launcher.log").read_text()
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 25))
    # steps trained while engine-1 was out: the survivor generated their batches alone
    assert any(r["rollout/engines_down"] == 1.0 for r in rows), [r["rollout/engines_down"] for r in rows]
    final = check_ledger(run)
    routing = final["routing"]
    assert routing["downs"] >= 1 and routing["ups"] >= 1, routing  # out, then back once restarted
    # the requests caught on the killed engine went to the survivor
    assert routing["lost_to_down_engine"] > 0, routing
    assert routing["groups_split"] == 0, routing  # a move forced by the death is not a split
    led = final["buffer"]["ledger"]
    # no trajectory failed for the death: nothing was dropped or retried as "failed"
    assert "failed" not in led["dropped_by_reason"], led["dropped_by_reason"]
    assert led["retried"] == 0, led
    # the restarted engine-1 generated again after it came back
    assert final["engines"]["engine-1"]["requests"] > 0, final["engines"]
