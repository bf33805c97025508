"""structlog set-up, once per process: JSON lines when stderr is not a terminal, colours when it is.

Context (``task_id``, ``node_id``, ``attempt``) is bound per RPC or loop with
``structlog.contextvars.bound_contextvars`` or ``log.bind``.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def configure_logging(*, level: str | None = None, json: bool | None = None) -> None:
    """Configure structlog and stdlib logging to write to stderr. Idempotent.

    Args:
        level: "debug", "info", ... (default: env ``OPENTINKER_LOG_LEVEL`` or "info").
        json: force JSON (True) or console (False) output; default: JSON unless stderr is a TTY,
            overridable with env ``OPENTINKER_LOG_FORMAT=json|console``.
    """
    global _configured
    if _configured:
        return
    _configured = True
    level_name = (level or os.environ.get("OPENTINKER_LOG_LEVEL") or "info").upper()
    numeric = getattr(logging, level_name, logging.INFO)
    if json is None:
        fmt = os.environ.get("OPENTINKER_LOG_FORMAT")
        json = (fmt == "json") if fmt else not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(
        level=max(numeric, logging.WARNING), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
