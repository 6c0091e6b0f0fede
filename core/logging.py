"""structlog setup: key-value events, JSON when stderr is not a TTY, context via contextvars.

With a log file (the local launcher's default), every event goes to the file as one JSON
line and only warnings and errors reach the console, each as one readable line
(`readable_line`), so progress output stays clean.
"""

from __future__ import annotations

import json as _json
import logging
import sys
from pathlib import Path
from typing import IO, Any

import structlog

_configured = False
LEVELS = logging.getLevelNamesMapping()
# context keys every event carries; the readable line shows them as a prefix or not at all
_CONTEXT_KEYS = ("timestamp", "level", "event", "run", "role", "rank")


def readable_line(ev: dict[str, Any]) -> str:
    """`warning [engine-0] event_name: key=value ...` for one event dict (a parsed JSON line)."""
    role = ev.get("role", "")
    who = f"{role}-{ev['rank']}" if role and "rank" in ev else str(role)
    rest = " ".join(f"{k}={_short(v)}" for k, v in ev.items() if k not in _CONTEXT_KEYS)
    head = f"{ev.get('level', 'info')} [{who}] {ev.get('event', '?')}" if who else \
        f"{ev.get('level', 'info')} {ev.get('event', '?')}"
    return f"{head}: {rest}" if rest else head


def _short(v: Any, limit: int = 300) -> str:
    s = v if isinstance(v, str) else _json.dumps(v, default=str)
    s = " ".join(s.split())  # one line, whatever the value held
    return s if len(s) <= limit else s[: limit - 3] + "..."


class _FileAndConsole:
    """Final processor: the event as JSON to the file; warnings and up also readable to the console."""

    def __init__(self, file: IO[str], console: IO[str], console_level: int) -> None:
        self.file, self.console, self.console_level = file, console, console_level

    def __call__(self, _logger: Any, _method: str, ev: dict[str, Any]) -> Any:
        self.file.write(_json.dumps(ev, default=str) + "\n")
        self.file.flush()
        if LEVELS.get(str(ev.get("level", "info")).upper(), logging.INFO) >= self.console_level:
            self.console.write(readable_line(ev) + "\n")
            self.console.flush()
        raise structlog.DropEvent


def configure_logging(level: str = "info", json: bool | None = None, *, file: str | Path | None = None,
                      console_level: str = "warning", **context: Any) -> None:
    """Configure structlog once per process; bind run/role/rank context for every event.

    `file`: write every event there as JSON and only `console_level` and up to stderr.
    """
    global _configured
    if json is None:
        json = not sys.stderr.isatty()
    final: Any
    if file is not None:
        Path(file).parent.mkdir(parents=True, exist_ok=True)
        final = _FileAndConsole(Path(file).open("a"), sys.stderr,
                                LEVELS.get(console_level.upper(), logging.WARNING))
    else:
        final = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            final,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            LEVELS.get(level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    if context:
        bind(**context)
    _configured = True


def bind(**context: Any) -> None:
    """Bind context (run, role, rank, step, version) to every later event in this task."""
    structlog.contextvars.bind_contextvars(**context)


def get_logger(name: str = "miles") -> Any:
    if not _configured:
        configure_logging()
    return structlog.get_logger(name)
