"""Start one worker process per rank and wait for all of them, killing stragglers (bench helper)."""

from __future__ import annotations

import subprocess


def run_workers(argvs: list[list[str]], env: dict[str, str], timeout: float, what: str) -> None:
    procs = [subprocess.Popen(argv, env=env) for argv in argvs]
    rcs: list[int | None] = [None] * len(procs)
    try:
        rcs = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(rcs):
        raise SystemExit(f"{what} exited {rcs}")
