"""Why a role exited and whether to start it again: the rule every supervisor applies.

A role process reports a crash itself: `report_crash` logs a `role_failed` error event with the
exception's last line (`Type: message`) and whether it had started serving (`started`), and
whether the error is one that will happen again whatever the attempt (`fatal`, a
`StartupError`). The supervisor (launch/local.py; one for Slurm can call the same) reads that
event back from the role's log (`crash_report`) and asks `RestartPolicy.decide`:

- a role that exits before it ever became ready (its ready file, written once its actors
  serve) is not restarted: a failure at start (weights missing, a package missing, a config
  the engine refuses, an external server that will not start) happens again on every try,
  and retrying it only hides the cause behind three restart lines;
- a role whose error is a `StartupError` is not restarted either, whenever it raised;
- a role that had served is restarted, up to `max_restarts` (a crash mid-run: an OOM, a
  killed process, a lost GPU), as before.

The decision carries the reason, so the console says why in one line.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from miles.core.errors import StartupError
from miles.core.logging import get_logger

log = get_logger("miles.role")
REASON_CHARS = 290  # fits the console's one-line value limit (core/logging.py)


def exception_line(exc: BaseException) -> str:
    """A traceback's last line, `Type: message`, on one line; a long message keeps its head and
    its tail (where a wrapped error, e.g. a server's own error line, usually ends up)."""
    msg = str(exc)
    text = " ".join((f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__).split())
    if len(text) <= REASON_CHARS:
        return text
    head = REASON_CHARS // 3
    return text[:head] + " ... " + text[-(REASON_CHARS - head - 5):]


def report_crash(exc: BaseException, started: bool) -> None:
    """In the role process, as it dies: the event the supervisor reads (and the traceback, to
    stderr = the role's log, for whoever reads it)."""
    traceback.print_exception(exc)
    log.error("role_failed", error=exception_line(exc), started=started, fatal=isinstance(exc, StartupError))


@dataclass
class CrashReport:
    reason: str = ""  # "Type: message", or "" when the role logged nothing (killed by a signal)
    fatal: bool = False


def crash_report(log_path: Path, start: int = 0, tail_bytes: int = 1 << 16) -> CrashReport:
    """The crash a role's log holds past byte `start` (where this incarnation began): its
    `role_failed` event, else the last error event's `error` (a role that died elsewhere), else
    the last line of a Python traceback; an empty report for a role killed by a signal."""
    try:
        with log_path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(start, size - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return CrashReport()
    fatal = _fatal_signal(lines)
    if fatal:
        return CrashReport(fatal)
    fallback = ""
    for ln in reversed(lines):
        if not ln.strip():
            continue
        ev = _event(ln)
        if ev is None:
            # a plain stderr line: the last one of a traceback names the exception
            if not fallback and not ln.startswith((" ", "Traceback")) and ":" in ln:
                fallback = " ".join(ln.split())[:REASON_CHARS]
            continue
        if ev.get("event") == "role_failed":
            return CrashReport(str(ev.get("error", "")), bool(ev.get("fatal", False)))
        if ev.get("level") == "error" and ev.get("error") and not fallback:
            fallback = " ".join(str(ev["error"]).split())[:REASON_CHARS]
    return CrashReport(fallback)


def _fatal_signal(lines: list[str]) -> str:
    """faulthandler's report of a fatal signal (launch/role.py enables it), as one line: the
    error and the two innermost frames of the thread that crashed ("Fatal Python error:
    Segmentation fault at FILE:LINE in FUNCTION < its caller's FILE:LINE in FUNCTION"; a path
    inside miles is shown from the package root); '' when there is none."""
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Fatal Python error:")]
    if not starts:
        return ""
    frames: list[str] = []
    for ln in lines[starts[-1] + 1:]:
        frame = ln.strip()
        if frames and not frame.startswith("File "):
            break  # the end of the crashing thread's stack (it is listed first)
        if frame.startswith("File "):  # File "/x/miles/engines/sglang.py", line 212 in update_weights
            path, _, rest = frame[len('File "'):].partition('", line ')
            where = path.split("/miles/", 1)[1] if "/miles/" in path else "/".join(path.split("/")[-2:])
            line_no, _, func = rest.partition(" in ")
            frames.append(f"{where}:{line_no} in {func}")
    head = " ".join(lines[starts[-1]].split())
    return (f"{head} at {' < '.join(frames[:2])}" if frames else head)[:REASON_CHARS]


def _event(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None
    try:
        ev = json.loads(line)
    except json.JSONDecodeError:
        return None
    return ev if isinstance(ev, dict) else None


Action = Literal["restart", "stop"]


@dataclass
class Decision:
    action: Action
    why: str  # the event name the supervisor logs: role_crashed_restarting, role_failed_at_start, ...


@dataclass
class RestartPolicy:
    max_restarts: int = 3

    def decide(self, *, served: bool, fatal: bool, restarts: int) -> Decision:
        """For a restartable role (engine) that exited with an error; see the module doc."""
        if fatal:
            return Decision("stop", "role_failed_fatal")
        if not served:
            return Decision("stop", "role_failed_at_start")
        if restarts >= self.max_restarts:
            return Decision("stop", "role_gave_up")
        return Decision("restart", "role_crashed_restarting")
