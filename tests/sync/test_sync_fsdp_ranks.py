"""A 2-rank FSDP trainer (gloo, two processes) syncs to 2 engine processes over every CPU
transport (zmq, ucx over TCP when UCXX is installed, broadcast/gloo, disk_delta): afterwards
every engine's weights are bit-equal to the trainer's and the checksum check passed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from miles.actors.messages import Health
from miles.core.ports import group_port

from .sync_helpers import client, held, start_engines

RANK = Path(__file__).with_name("procs") / "sync_fsdp_rank.py"
pytestmark = pytest.mark.timeout(240)


async def test_two_fsdp_ranks_sync_every_transport(procs, tmp_path: Path) -> None:
    directory = start_engines(procs, extra=["--hidden", "256"])
    port = str(group_port())
    env = {"OMP_NUM_THREADS": "1", "UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_TLS": "tcp,self"}
    ranks = [procs.spawn([str(RANK), str(r), "2", port, directory, str(tmp_path)], env=env, ready=False)[0]
             for r in range(2)]
    for p in ranks:
        try:
            p.wait(200)
        except Exception:  # noqa: BLE001 - report the rank's log, the fixture stops it
            pytest.fail(f"trainer rank did not finish: {procs.log_of(p)}")
        assert p.returncode == 0, procs.log_of(p)
    reports = json.loads((tmp_path / "reports.json").read_text())
    want = ["zmq", *(["ucx"] if importlib.util.find_spec("ucxx") else []), "broadcast", "disk_delta", "zmq-flat"]
    assert [r["transport"] for r in reports] == want
    for r in reports:
        assert r["committed"] == ["e0", "e1"] and r["dead"] == [] and r["verified"] is True, r
        assert r["buckets"] >= 2, r
    sums = json.loads((tmp_path / "trainer_checksums.json").read_text())
    host = await client(directory)
    try:
        assert await held(host, ["e0", "e1"]) == [sums] * 2
        for e in ("e0", "e1"):
            assert (await host.ref(e).ask(Health(), timeout=10)).version == len(want)
    finally:
        await host.stop()


