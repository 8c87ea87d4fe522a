"""Structured logging: one event per line on stderr, human-readable or JSON."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(level: str | None = None, json: bool | None = None) -> None:
    """Configure structlog (and stdlib logging, which it renders too) for a process.

    Defaults come from SPECSERVE_LOG_LEVEL (default "info") and SPECSERVE_LOG_JSON ("1" for JSON).
    """
    level_name = (level or os.environ.get("SPECSERVE_LOG_LEVEL", "info")).upper()
    numeric = logging.getLevelNamesMapping().get(level_name)
    if numeric is None:
        raise ValueError(f"unknown log level {level_name.lower()!r}")
    as_json = json if json is not None else os.environ.get("SPECSERVE_LOG_JSON") == "1"
    renderer = (
        structlog.processors.JSONRenderer()
        if as_json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
