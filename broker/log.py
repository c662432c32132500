"""structlog set-up: console lines for people, JSON lines for machines.

Events are named like RabbitMQ's log lines. Nothing is logged per message on the hot path.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure(fmt: str = "console", level: str = "info", stream=None) -> None:
    stream = stream or sys.stderr
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=stream.isatty()))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def get(node: str | None = None):
    log = structlog.get_logger("warren")
    return log.bind(node=node) if node else log


CLIP = 64  # characters of a client's string a log line keeps (`clip`)


def clip(text, limit: int = CLIP) -> str:
    """A string a stranger chose (a user name, a reason built from one), bounded for a log line
    or an error: the first `limit` characters and the whole length when it is longer."""
    text = text if isinstance(text, str) else repr(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} chars)"


class Throttled:
    """Log lines strangers can cause (failed logins, refused or timed-out handshakes) at most one
    per `every` seconds per event, each with the count of the lines held back since the last one
    (`suppressed`). `now` is the clock (trio.current_time under a running node)."""

    def __init__(self, log, now, every: float = 1.0):
        self.log = log
        self.now = now
        self.every = every
        self._last: dict[str, float] = {}  # event -> when its last line was written
        self._held: dict[str, int] = {}  # event -> lines held back since

    def warning(self, event: str, **fields) -> bool:
        """Write the line, or count it as held back; True if it was written."""
        now = self.now()
        last = self._last.get(event)
        if last is not None and now - last < self.every:
            self._held[event] = self._held.get(event, 0) + 1
            return False
        self._last[event] = now
        held = self._held.pop(event, 0)
        if held:
            fields["suppressed"] = held
        self.log.warning(event, **fields)
        return True
