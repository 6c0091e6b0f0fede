"""Everything miles reads from Slurm's environment, in one place, plus host-list expansion.

`SlurmEnv.from_environ()` is the only reader of `SLURM_*` / `SLURMD_*` variables in
miles; the launcher and the per-step entry take their job, node and task facts from it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from miles.core.errors import ConfigError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


@dataclass(frozen=True)
class SlurmEnv:
    """The Slurm facts of this process; empty/None when not inside a job or a step."""

    job_id: str = ""  # SLURM_JOB_ID: set inside an allocation (sbatch, salloc, srun)
    job_name: str = ""  # SLURM_JOB_NAME
    nodelist: str = ""  # SLURM_JOB_NODELIST, compressed (e.g. "gpu[01-04],login1")
    num_nodes: int = 0  # SLURM_JOB_NUM_NODES
    submit_dir: str = ""  # SLURM_SUBMIT_DIR
    step_id: str = ""  # SLURM_STEP_ID: set inside an srun step
    proc_id: int | None = None  # SLURM_PROCID: task rank within the step
    local_id: int | None = None  # SLURM_LOCALID: task rank on this node within the step
    node_id: int | None = None  # SLURM_NODEID: this node's index within the step
    ntasks: int | None = None  # SLURM_NTASKS: tasks of the step (or of the job outside a step)
    node_name: str = ""  # SLURMD_NODENAME: the Slurm name of this node

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> SlurmEnv:
        e = os.environ if env is None else env
        return cls(
            job_id=e.get("SLURM_JOB_ID", ""),
            job_name=e.get("SLURM_JOB_NAME", ""),
            nodelist=e.get("SLURM_JOB_NODELIST", "") or e.get("SLURM_NODELIST", ""),
            num_nodes=_int(e, "SLURM_JOB_NUM_NODES") or _int(e, "SLURM_NNODES") or 0,
            submit_dir=e.get("SLURM_SUBMIT_DIR", ""),
            step_id=e.get("SLURM_STEP_ID", ""),
            proc_id=_int(e, "SLURM_PROCID"),
            local_id=_int(e, "SLURM_LOCALID"),
            node_id=_int(e, "SLURM_NODEID"),
            ntasks=_int(e, "SLURM_NTASKS"),
            node_name=e.get("SLURMD_NODENAME", ""),
        )

    @property
    def in_allocation(self) -> bool:
        return bool(self.job_id)

    @property
    def in_step(self) -> bool:
        return bool(self.step_id) and self.proc_id is not None

    def hosts(self) -> list[str]:
        """The job's node names in allocation order (SLURM_JOB_NODELIST expanded)."""
        if not self.nodelist:
            raise ConfigError("SLURM_JOB_NODELIST is not set: this process is not inside a Slurm job")
        return expand_nodelist(self.nodelist)

    def port_offset(self, span: int) -> int:
        """A job-specific number in [0, span): concurrent jobs on shared nodes pick distinct ports."""
        return int(self.job_id) % span if self.job_id.isdigit() else 0


def _int(e: Mapping[str, str], key: str) -> int | None:
    v = e.get(key, "")
    if not v:
        return None
    try:
        return int(v.split("(")[0])  # some counts look like "2(x3)"
    except ValueError as exc:
        raise ConfigError(f"environment variable {key}={v!r} is not an integer") from exc


def expand_nodelist(spec: str) -> list[str]:
    """`"n[1-3,7],gpu[01-02]-ib"` -> `["n1", "n2", "n3", "n7", "gpu01-ib", "gpu02-ib"]`.

    Follows Slurm's host-list syntax: comma-separated names, each with any number of
    bracketed ranges; a range keeps the zero padding of its start ("[08-10]").
    """
    out: list[str] = []
    for item in _split_top(spec.strip(), spec):
        out.extend(_expand_item(item, spec))
    if not out:
        raise ConfigError(f"empty Slurm node list {spec!r}")
    return out


def _split_top(s: str, spec: str) -> list[str]:
    items: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in s:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"nested '[' in Slurm node list {spec!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"unbalanced ']' in Slurm node list {spec!r}")
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ConfigError(f"unbalanced '[' in Slurm node list {spec!r}")
    items.append("".join(cur))
    return [i.strip() for i in items if i.strip()]


def _expand_item(item: str, spec: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    head, body, tail = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    values: list[str] = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise ConfigError(f"bad range {part!r} in Slurm node list {spec!r}")
        lo_s, hi_s = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise ConfigError(f"descending range {part!r} in Slurm node list {spec!r}")
        values.extend(str(v).zfill(len(lo_s)) for v in range(lo, hi + 1))
    return [head + v + rest for v in values for rest in _expand_item(tail, spec)]
