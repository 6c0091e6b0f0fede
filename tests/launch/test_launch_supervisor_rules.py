"""The shared supervisor's rules (launch/supervisor.py) over real processes: which exit ends the run,
which role is started again. Each unit is a local `Child` running a short Python program that
writes its ready file (it served) or not, then exits with a given code."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from miles.core.logging import configure_logging
from miles.launch.local import Child
from miles.launch.supervision import RestartPolicy
from miles.launch.supervisor import Supervisor, stop_units

pytestmark = pytest.mark.timeout(60)


def unit(tmp: Path, role: str, *, serves: bool, code: int, runs: int = 1, index: int = 0,
         after: tuple[Path, int] | None = None) -> Child:
    """A role that (optionally) becomes ready, then exits `code`; after `runs` starts it stays up.
    With `after` = (count file, k) it exits only once another unit has been started k times."""
    log = tmp / f"{role}-{index}.log"
    count = tmp / f"{role}-{index}.count"
    wait = "" if after is None else (
        f"w = pathlib.Path({str(after[0])!r})\n"
        "def seen():\n"
        "    try:\n"
        "        return int(w.read_text())\n"
        "    except (OSError, ValueError):  # not written yet, or caught mid-write\n"
        "        return 0\n"
        f"while seen() < {after[1]}: time.sleep(0.02)\n")
    prog = (
        "import pathlib, sys, time\n" + wait +
        f"c = pathlib.Path({str(count)!r}); n = int(c.read_text()) + 1 if c.exists() else 1; c.write_text(str(n))\n"
        f"if {serves}: pathlib.Path({str(log.with_suffix('.ready'))!r}).write_text('x')\n"
        f"if n > {runs}: time.sleep(60)\n"
        f"print('RuntimeError: {role} broke', file=sys.stderr); sys.exit({code})\n"
    )
    return Child(role, index, [sys.executable, "-c", prog], dict(os.environ), log)


def starts(c: Child) -> int:
    p = c.log_path.with_suffix(".count")
    return int(p.read_text()) if p.exists() else 0


async def supervise(units: list[Child], max_restarts: int = 3) -> int:
    for u in units:
        u.start()
    try:
        return await Supervisor(list(units), RestartPolicy(max_restarts), "miles train --resume R",
                                asyncio.Event(), poll_s=0.05).run()
    finally:
        await stop_units(list(units), grace_s=5.0)


def events(path: Path) -> list[dict[str, object]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.startswith("{")]


@pytest.fixture
def event_log(tmp_path: Path) -> Path:
    path = tmp_path / "launcher.log"
    configure_logging("info", True, file=path, run="t", role="launcher")
    return path


async def test_trainers_exiting_0_end_the_run_with_0(tmp_path: Path, event_log: Path) -> None:
    a = unit(tmp_path, "trainer", serves=True, code=0)
    b = unit(tmp_path, "trainer", serves=True, code=0, index=1)
    assert await supervise([a, b]) == 0


async def test_a_served_engine_is_restarted_then_the_run_goes_on(tmp_path: Path, event_log: Path) -> None:
    engine = unit(tmp_path, "engine", serves=True, code=1, runs=1)
    # the trainer finishes once the engine is back (its second start)
    trainer = unit(tmp_path, "trainer", serves=True, code=0, after=(tmp_path / "engine-0.count", 2))
    assert await supervise([engine, trainer]) == 0
    assert starts(engine) == 2
    ev = [e for e in events(event_log) if e["event"] == "role_crashed_restarting"]
    assert [(e["role"], e["restart"]) for e in ev] == [("engine", 1)] and "engine broke" in str(ev[0]["cause"])


@pytest.mark.parametrize(("role", "serves", "event"), [
    ("engine", False, "role_failed_at_start"),  # would fail again: not restarted
    ("rollout", True, "rollout_crashed"),  # its buffer would be lost: never restarted
    ("rollout", False, "role_failed_at_start"),
    ("head", True, "head_exited"),  # the directory is gone
])
async def test_exits_that_end_the_run(tmp_path: Path, event_log: Path, role: str, serves: bool, event: str) -> None:
    failing = unit(tmp_path, role, serves=serves, code=1, runs=5)
    trainer = unit(tmp_path, "trainer", serves=True, code=0, runs=0)  # stays up
    assert await supervise([failing, trainer]) == 1
    assert starts(failing) == 1
    ev = next(e for e in events(event_log) if e["event"] == event)
    if role == "rollout" and serves:
        assert ev["hint"] == "resume with: miles train --resume R"


async def test_an_engine_out_of_restarts_ends_the_run(tmp_path: Path, event_log: Path) -> None:
    engine = unit(tmp_path, "engine", serves=True, code=1, runs=9)
    trainer = unit(tmp_path, "trainer", serves=True, code=0, runs=0)
    assert await supervise([engine, trainer], max_restarts=2) == 1
    assert starts(engine) == 3
    assert any(e["event"] == "role_gave_up" for e in events(event_log))
