"""The launcher's console: one progress line per step with ETA, warnings as readable lines.

Follows the run's files, not the processes: new rows of metrics.jsonl become progress lines,
new warning/error events in logs/*.log (JSON) become one readable line each. Diagnostics that
say only "this machine is busy" (event-loop lag) are counted for the end-of-run table instead,
and a warning repeating itself is shown a few times, then counted.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import IO, Any

from miles.core.logging import readable_line
from miles.metrics.progress import Progress

SUMMARIZED = {"event_loop_lag"}  # counted, not printed
SHOWN_BY_LAUNCHER = {"role_failed"}  # a role's crash: the launcher's decision line carries its cause
REPEATS_SHOWN = 3  # per (role, event)


def _startup(ev: dict[str, Any]) -> str | None:
    """What a start-up event says the run is waiting on, as one line (info events otherwise stay
    in the logs): the decode compile, the slow part of a cold start on a GPU."""
    who = f"{ev.get('role')}-{ev.get('rank')}"
    name = ev.get("event")
    if name == "decode_compile_started":
        return f"{who}: compiling the decode graphs in the background; serving with uncompiled graphs meanwhile"
    if name == "decode_compile_ready":
        return f"{who}: decode compile ready after {ev.get('compile_s')} s; serving compiled decode graphs"
    if name == "engine_warmed_up" and ev.get("compiled"):
        return f"{who}: decode graphs compiled and captured in {ev.get('seconds')} s before serving"
    return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class _Tail:
    """New complete lines of a growing file, from byte `pos` on."""

    def __init__(self, path: Path, pos: int = 0) -> None:
        self.path, self.pos, self.rest = path, pos, b""

    def lines(self) -> list[str]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.pos)
                data = f.read()
        except OSError:
            return []
        self.pos += len(data)
        data = self.rest + data
        *full, self.rest = data.split(b"\n")
        return [ln.decode(errors="replace") for ln in full if ln.strip()]


class Console:
    """Prints what the run's files say as it happens; `poll()` does one round."""

    def __init__(self, run_dir: str | Path, total_steps: int, *, progress: bool = True,
                 forward_warnings: bool = True, out: IO[str] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.total = total_steps
        self.progress, self.forward_warnings = progress, forward_warnings
        self.out = out or sys.stdout
        # a resumed (or reused) run directory appends: show only what this launch adds
        self._metrics = _Tail(self.run_dir / "metrics.jsonl", _size(self.run_dir / "metrics.jsonl"))
        self._log_start = {f: _size(f) for f in (self.run_dir / "logs").glob("*.log")}
        self._logs: dict[Path, _Tail] = {}
        self._shown: dict[tuple[str, str], int] = {}
        self._progress = Progress(total_steps)
        self.counted: dict[str, int] = {}

    def poll(self) -> None:
        for ln in self._metrics.lines():
            try:
                rec = json.loads(ln)
            except json.JSONDecodeError:
                continue
            self._on_step(rec)
        if self.forward_warnings:
            for f in sorted((self.run_dir / "logs").glob("*.log")):
                if f.name == "launcher.log":
                    continue  # the launcher prints its own warnings
                tail = self._logs.get(f) or self._logs.setdefault(f, _Tail(f, self._log_start.get(f, 0)))
                for ln in tail.lines():
                    self._on_log(ln)

    def _on_step(self, rec: dict[str, Any]) -> None:
        line = self._progress.line(rec, time.monotonic())
        if self.progress:
            self._print(line)

    def _on_log(self, ln: str) -> None:
        if '"level": "info"' in ln and ('decode_compile_' in ln or 'engine_warmed_up' in ln):
            try:
                line = _startup(json.loads(ln))
            except json.JSONDecodeError:
                return
            if line is not None:
                self._print(line)
            return
        if '"level": "warning"' not in ln and '"level": "error"' not in ln:
            return
        try:
            ev = json.loads(ln)
        except json.JSONDecodeError:
            return
        name = str(ev.get("event"))
        if name in SHOWN_BY_LAUNCHER:
            return
        if name in SUMMARIZED:
            self.counted[name] = self.counted.get(name, 0) + 1
            return
        key = (f"{ev.get('role')}-{ev.get('rank')}", name)
        n = self._shown[key] = self._shown.get(key, 0) + 1
        if n <= REPEATS_SHOWN or ev.get("level") == "error":
            self._print(readable_line(ev))
        elif n == REPEATS_SHOWN + 1:
            self._print(f"(further {name!r} from {key[0]} counted, not shown; see {self.run_dir / 'logs'})")

    def _print(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    async def follow(self, stop: asyncio.Event, interval_s: float = 0.2) -> None:
        """Poll until `stop` is set, then once more (the last rows)."""
        while not stop.is_set():
            self.poll()
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass
        self.poll()
