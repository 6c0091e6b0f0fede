"""Sharded weight sync, real processes: 4 FSDP trainer ranks (gloo) -> 2 engine processes.

Every rank sends only its own slices (transfer plan, weightsync/shard_plan.py), over ucx
(when UCXX is installed), zmq and broadcast (send/recv per rank-engine pair). After each of
3 versions per transport both engines hold exactly the trainer's model (checksums against
the gathered model, computed outside the sync), and no rank's sync created more than its
own shard plus one bucket (tracked allocations of every op on the syncing thread). A fourth
run sends deltas over broadcast after a sparse update (2 % of the elements change); a last
version goes through the trainer loop's hand-off (ShardedPublisher) with the engines paused.
ucx runs with the engines' receive-ahead (every rank's next bucket posted), with deltas over
it, and without it ("ucx-serial": each bucket received when its header comes up).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from miles.core.ports import group_port

from .sync_helpers import start_engines

RANK = Path(__file__).with_name("procs") / "sync_sharded_rank.py"
WORLD = 4
pytestmark = pytest.mark.timeout(240)


def test_four_fsdp_ranks_send_their_own_shards(procs, tmp_path: Path) -> None:
    ucx = ["ucx", "ucx-delta", "ucx-serial"] if importlib.util.find_spec("ucxx") else []
    transports = [*ucx, "zmq", "broadcast", "broadcast-delta"]
    directory = start_engines(procs, extra=["--hidden", "128"])
    port = str(group_port())
    env = {"OMP_NUM_THREADS": "1", "UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_TLS": "tcp,self"}
    ranks = [procs.spawn([str(RANK), str(r), str(WORLD), port, directory, str(tmp_path), ",".join(transports)],
                         env=env, ready=False)[0] for r in range(WORLD)]
    for p in ranks:
        try:
            p.wait(200)
        except Exception:  # noqa: BLE001 - report the rank's log, the fixture stops it
            pytest.fail(f"trainer rank did not finish: {procs.log_of(p)}")
        assert p.returncode == 0, procs.log_of(p)
    recs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    checks, reports, n = recs[0]["checks"], recs[0]["reports"], recs[0]["versions"]
    assert n >= 3  # a full version, deltas after it, a verified one
    assert [c["transport"] for c in checks] == [t for t in transports for _ in range(n)]
    assert all(c["exact"] == [True, True] for c in checks), checks
    model_bytes = sum(r["shard_bytes"] for r in recs)
    for i, rep in enumerate(reports):
        assert rep["committed"] == ["e0", "e1"] and rep["dead"] == [], rep
        assert rep["full_bytes"] == model_bytes and rep["buckets"] >= 2 * WORLD, rep
        if rep["transport"].endswith("-delta") and i % n:  # 2 % of the words changed: deltas after the first
            assert rep["bytes"] < model_bytes * 0.2, rep
        else:
            assert rep["bytes"] == model_bytes, rep
        if rep["version"] % n == 0:
            assert rep["verified"] is True, rep
    pub = [rec["publisher"] for rec in recs]  # the trainer loop's hand-off, every rank, rank 0 announcing
    assert pub[0]["exact"] == [True, True] and pub[0]["announced"] == [pub[0]["version"]], pub[0]
    assert all(p["announced"] == [] and p["last_version"] == pub[0]["version"] for p in pub[1:]), pub
    assert all(p["payload"] == model_bytes for p in pub)
    for r, rec in enumerate(recs):
        bound = rec["shard_bytes"] + rec["bucket_bytes"]
        assert rec["shard_bytes"] < model_bytes / 2  # a real shard, not the model
        # everything the rank's export + push created, summed, fits its shard + one bucket
        assert rec["total_max"] <= bound, (r, rec["total_max"], bound)
        assert rec["largest"] <= bound, (r, rec["largest"], bound)
        # a delta sync also keeps its base: one more shard
        assert rec["total_max_delta"] <= bound + rec["shard_bytes"], (r, rec["total_max_delta"], bound)
        assert rec["gathered_total"] >= model_bytes > bound  # the tracker does see a gather's allocations
