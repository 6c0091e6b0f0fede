"""`srun -N2 -n2 miles perftest` on the project's local Slurm cluster: one rank per virtual node.

Skipped unless `sinfo` shows two idle nodes (scripts/slurm/local-cluster.sh starts them).
The ranks meet through the rendezvous file in the submit directory (tmp_path, which the
virtual nodes share), or through a fixed port on the first node with `--port`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from miles.core.ports import group_port

from .perftest_helpers import SMALL, check_outputs, perftest


def _idle_nodes() -> str:
    if shutil.which("sinfo") is None or shutil.which("srun") is None:
        return "no Slurm client (sinfo/srun) on PATH; scripts/slurm/local-cluster.sh starts a local cluster"
    try:
        res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "sinfo timed out: slurmctld is not answering"
    idle = {ln.split()[0] for ln in res.stdout.splitlines() if ln.split()[1:] in (["idle"], ["mix"])}
    return "" if res.returncode == 0 and len(idle) >= 2 else f"need 2 idle Slurm nodes, sinfo: {res.stdout.strip()!r}"


WHY = _idle_nodes()
pytestmark = [pytest.mark.skipif(bool(WHY), reason=WHY or "-"), pytest.mark.timeout(60)]


@pytest.mark.parametrize("meet", ["rendezvous-file", "fixed-port"])
def test_two_ranks_on_two_nodes(tmp_path: Path, meet: str) -> None:
    j, c = tmp_path / "o.json", tmp_path / "o.csv"
    extra = ["--port", str(group_port())] if meet == "fixed-port" else []
    name = f"perftest-{os.getpid()}-{meet}"
    try:
        res = perftest("--transport", "zmq-bulk", "--pattern", "stream", *SMALL, *extra, "--json", str(j),
                       "--csv", str(c), cwd=tmp_path, timeout=55,
                       prefix=["srun", "-N2", "-n2", "-t", "2", f"--job-name={name}"])
    finally:
        subprocess.run(["scancel", f"--name={name}"], capture_output=True)
    assert res.returncode == 0, res.stderr[-3000:]
    check_outputs(j, c, "zmq-bulk", "stream", [8, 512, 32768])
    meta = json.loads(j.read_text())["meta"]
    assert len(set(meta["nodes"])) == 2, meta  # rank 0 and rank 1 ran on different nodes
    assert res.stdout.count("# miles perftest") == 1  # only rank 0 reports
    assert not list(tmp_path.glob(".miles-perftest-*"))  # the rendezvous file is removed
