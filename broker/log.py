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
