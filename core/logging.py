"""structlog setup: key-value events, JSON when stderr is not a TTY, context via contextvars."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_configured = False


def configure_logging(level: str = "info", json: bool | None = None, **context: Any) -> None:
    """Configure structlog once per process; bind run/role/rank context for every event."""
    global _configured
    if json is None:
        json = not sys.stderr.isatty()
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
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
