"""Runs that lose messages (transport.faults) still finish, with every loss accounted for.

- Every `rollout.SetVersion` lost, in sync mode: sync opens a version's groups only once the
  rollout side knows that version. It learned it only from SetVersion, a tell, so one lost
  announcement stalled generation until the trainer's pull deadline; PullBatch carries the
  version too, and the rollout side now takes it from there.
- Half of the `engine.Generate` / `engine.GenerateMany` requests and replies lost: each fails its
  trajectories at `rollout.generate_timeout_s`, the group is dropped with its reason and its
  prompt retried. (A GenerateMany carries every request of a loop iteration, so a short run sends
  only a handful; at 20% a run lost none about one time in ten. The fault hook draws for every
  message, heartbeats included, so its seed does not pin which ones.)
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
    # 2 steps: each lost request waits out its deadline, one after another (~6 a run), so the deadline
    # is the run's length: 1 s, still ~10x a healthy GenerateMany of 8 x 6 tokens here (a healthy one
    # that misses it only fails and retries its group too). Such a run sends ~14 Generate(Many)
    # requests and replies (7 of them lost in one try), so it loses none about once in 10^4 at 50%
    train(run, cache, {"run.steps": "2", "run.log_level": "info", "rollout.generate_timeout_s": "1",
                       "transport.faults.drop_rate": "0.5",
                       "transport.faults.drop_types": '["engine.Generate", "engine.GenerateMany"]',
                       "transport.faults.seed": "1"}, timeout=120)
    assert [r["step"] for r in metrics(run)] == [1, 2]
    lost = len(_events(run, "rollout", "message_dropped")) + len(_events(run, "engine", "message_dropped"))
    # the message gives the deadline left when the ask was sent: "within 1s", "within 0.999s" (the
    # 1 s deadline less the moments before the send; not another one, such as the 30 s default)
    at_deadline = re.compile(r"PeerTimeout: no reply from 'engine-0' .* within (1|0\.[5-9]\d*)s \(request Generate")
    timed_out = [e for e in _events(run, "rollout", "trajectory_failed") if at_deadline.search(str(e["error"]))]
    assert lost >= 1 and len(timed_out) >= 1
    entries = rollout_state(run)["buffer"]["ledger"]["entries"]
    failed = [e for e in entries if any("failed" in r for r in e.get("reasons", []))]
    assert failed, "a group with a lost Generate is dropped with its reason"
