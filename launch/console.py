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

SUMMARIZED = {"event_loop_lag"}  # counted, not printed
SHOWN_BY_LAUNCHER = {"role_failed"}  # a role's crash: the launcher's decision line carries its cause
REPEATS_SHOWN = 3  # per (role, event)


def _fmt_eta(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def progress_line(rec: dict[str, Any], total: int, rewards: list[float], elapsed: float, done: int) -> str:
    """`step  12/120  10% | reward 0.39 (avg10 0.35) | ... | ETA 0:12` for one metrics row."""
    step = int(rec.get("step", 0))
    avg = rewards[-10:]
    parts = [f"step {step:{len(str(total))}d}/{total} {100 * step // max(total, 1):3d}%"]
    if "rollout/reward_mean" in rec:
        parts.append(f"reward {rec['rollout/reward_mean']:.3f} (avg10 {sum(avg) / len(avg):.3f})")
    if "rollout/fully_async/avg_staleness" in rec:
        parts.append(f"stale {rec['rollout/fully_async/avg_staleness']:.2f}")
    if "rollout/fully_async/len_ratio" in rec:
        parts.append(f"len_ratio {rec['rollout/fully_async/len_ratio']:.2f}")
    if "train/train_rollout_logprob_abs_diff" in rec:
        parts.append(f"Δlogp {rec['train/train_rollout_logprob_abs_diff']:.4f}")
    if "perf/step_time_s" in rec:
        parts.append(f"step {rec['perf/step_time_s']:.2f}s")
    if "perf/sync_s" in rec:
        parts.append(f"sync {rec['perf/sync_s'] * 1e3:.0f}ms")
    rate = done / elapsed if elapsed > 0 and done else 0.0
    parts.append(f"ETA {_fmt_eta((total - step) / rate)}" if rate else "ETA -")
    return " | ".join(parts)


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
        self.rewards: list[float] = []
        self.started: float | None = None  # when the first step landed (ETA excludes start-up)
        self.first_step = 0
        self._steps_s = 0.0  # perf/step_time_s of the steps after the first
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
        now = time.monotonic()
        if "rollout/reward_mean" in rec:
            self.rewards.append(float(rec["rollout/reward_mean"]))
        step = int(rec.get("step", 0))
        step_s = float(rec.get("perf/step_time_s", 0.0))
        if self.started is None:
            self.started, self.first_step = now, step
            # one step's time stands in for the rate until there are two
            elapsed, done = step_s, 1
        else:
            # Rows arrive in bursts (one poll reads every row written since the last): the wall
            # time since the first row can be ~0 for the next ones, which made the rate infinite
            # and the ETA 0:00 on step 2. The steps' own times bound the elapsed time from below.
            self._steps_s += step_s
            elapsed, done = max(now - self.started, self._steps_s), step - self.first_step
        if self.progress:
            self._print(progress_line(rec, self.total, self.rewards or [0.0], elapsed, done))

    def _on_log(self, ln: str) -> None:
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
