"""Runs that lose messages (transport.faults) still finish, with every loss accounted for.

- Every `rollout.SetVersion` lost, in sync mode: sync opens a version's groups only once the
  rollout side knows that version. It learned it only from SetVersion, a tell, so one lost
  announcement stalled generation until the trainer's pull deadline; PullBatch carries the
  version too, and the rollout side now takes it from there.
- The first `engine.GenerateMany` request and the first reply lost: each fails its trajectories
  at `rollout.generate_timeout_s`, the group is dropped with its reason and its prompt retried.
  (`drop_limit` pins the loss to each process's first message of those types; a rate would leave
  which ones to the draw, and a loss near the run's end has no deadline inside the run.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from .run_helpers import metrics, rollout_state, train


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("miles-cache")


def _events(run: Path, role: str, event: str) -> list[dict[str, object]]:
    lines = (run / "logs" / f"{role}-0.log").read_text().splitlines()
    return [json.loads(ln) for ln in lines if f'"{event}"' in ln]


@pytest.mark.timeout(150)
def test_sync_run_finishes_with_every_set_version_lost(tmp_path: Path, cache: Path) -> None:
    run = tmp_path / "run"
    train(run, cache, {"buffer.mode": "sync", "run.log_level": "info", "transport.faults.drop_rate": "1.0",
                       "transport.faults.drop_types": '["rollout.SetVersion"]'}, timeout=100)
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/fully_async/max_staleness"] == 0 for r in rows)  # sync's bound still holds
    drops = _events(run, "trainer", "message_dropped")
    assert len(drops) >= 3 and {d["message"] for d in drops} == {"tell:rollout.SetVersion"}


@pytest.mark.timeout(150)
def test_lost_generate_requests_fail_their_trajectories_at_the_deadline(tmp_path: Path, cache: Path) -> None:
    run = tmp_path / "run"
    # Each process drops exactly its first Generate(Many) message (drop_limit 1 at rate 1): the
    # rollout its first ask, the engine its first reply, both early in the run. A rate alone left
    # which ones to the draw: a CI run lost only the last reply, whose deadline fell after the
    # run's end, and so failed no trajectory. The 1 s deadline is ~10x a healthy GenerateMany of
    # 8 x 6 tokens here (a healthy one that misses it only fails and retries its group too).
    train(run, cache, {"run.steps": "2", "run.log_level": "info", "rollout.generate_timeout_s": "1",
                       "transport.faults.drop_rate": "1.0", "transport.faults.drop_limit": "1",
                       "transport.faults.drop_types": '["engine.Generate", "engine.GenerateMany"]'}, timeout=120)
    assert [r["step"] for r in metrics(run)] == [1, 2]
    lost = len(_events(run, "rollout", "message_dropped")) + len(_events(run, "engine", "message_dropped"))
    # the message gives the deadline left when the ask was sent: "within 1s", "within 0.999s" (the
    # 1 s deadline less the moments before the send; not another one, such as the 30 s default)
    at_deadline = re.compile(r"PeerTimeout: no reply from 'engine-0' .* within (1|0\.[5-9]\d*)s \(request Generate")
    timed_out = [e for e in _events(run, "rollout", "trajectory_failed") if at_deadline.search(str(e["error"]))]
    assert lost == 2 and len(timed_out) >= 1, (lost, len(timed_out))
    entries = rollout_state(run)["buffer"]["ledger"]["entries"]
    failed = [e for e in entries if any("failed" in r for r in e.get("reasons", []))]
    assert failed, "a group with a lost Generate is dropped with its reason"
