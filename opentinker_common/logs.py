"""structlog set-up, once per process: JSON lines when stderr is not a terminal, colours when it is.

Context (``task_id``, ``node_id``, ``attempt``) is bound per RPC or loop with
``structlog.contextvars.bound_contextvars`` or ``log.bind``.

On a terminal, control characters in logged strings are written as escapes (``\\x1b``, ``\\n``;
:func:`escape_control_characters`): a value a client or node sent (a refused registration's node
id, a worker's error text) must not retitle or recolour the operator's terminal or forge a log
line. JSON lines escape them already.
"""

from __future__ import annotations

import datetime
import json as pyjson
import logging
import os
import sys
import time
from typing import Any

import structlog

_configured = False

#: Logged fields that are multi-line by nature (tracebacks): their newlines and tabs stay.
_MULTILINE_FIELDS = frozenset({"exception", "stack"})
#: structlog's ConsoleRenderer shows a value holding one of these with ``repr()`` (which escapes
#: control characters itself); the others, and the event text, as they are.
_REPR_TRIGGERS = frozenset(" \t=\r\n\"'")


def _escaped(text: str, *, multiline: bool) -> str:
    from opentinker_common.spec import is_control_character

    if not any(is_control_character(c) for c in text):
        return text
    out = []
    for c in text:
        if not is_control_character(c) or (multiline and c in "\n\t"):
            out.append(c)
        elif c in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[c])
        else:
            out.append(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
    return "".join(out)


def escape_control_characters(_logger, _method: str, event: dict) -> dict:
    """A structlog processor for console output: string values with their control characters (the
    set :func:`opentinker_common.spec.is_control_character` names) written as escapes.
    ``exception`` and ``stack`` keep their newlines and tabs; a value the renderer will show with
    ``repr()`` anyway (:data:`_REPR_TRIGGERS`) is left to it, so nothing is escaped twice."""
    for key, value in event.items():
        if not isinstance(value, str):
            continue
        if key in _MULTILINE_FIELDS:
            event[key] = _escaped(value, multiline=True)
        elif key == "event" or not (_REPR_TRIGGERS & set(value)):
            event[key] = _escaped(value, multiline=False)
    return event


class _UtcTimestamp:
    """structlog's ``TimeStamper(fmt="iso", utc=True)`` (``timestamp``: ``2026-12-02T14:06:43.933425Z``,
    no fraction when the microseconds are 0), with the date and time to the second formatted once
    a second instead of once a line."""

    def __init__(self) -> None:
        self._second: tuple[int, str] = (-1, "")

    def __call__(self, _logger, _method: str, event: dict) -> dict:
        second, ns = divmod(time.time_ns(), 1_000_000_000)
        cached = self._second
        if cached[0] != second:  # one tuple: a thread sees an old or a new pair, never a mix
            text = datetime.datetime.fromtimestamp(second, datetime.timezone.utc).replace(tzinfo=None).isoformat()
            cached = self._second = (second, text)
        micro = ns // 1000
        event["timestamp"] = f"{cached[1]}.{micro:06d}Z" if micro else f"{cached[1]}Z"
        return event


def _json_fallback(value: Any) -> Any:
    """What structlog's ``JSONRenderer`` writes for a value JSON has no type for."""
    try:
        return value.__structlog__()
    except AttributeError:
        return repr(value)


class _JsonLine:
    """structlog's ``JSONRenderer()`` (``json.dumps(event, default=...)``) with one encoder made
    at start instead of one per line."""

    def __init__(self) -> None:
        self._encode = pyjson.JSONEncoder(default=_json_fallback).encode

    def __call__(self, _logger, _method: str, event: dict) -> str:
        return self._encode(event)


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
    renderers = [_JsonLine()] if json else [escape_control_characters, structlog.dev.ConsoleRenderer()]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _UtcTimestamp(),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            *renderers,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # WriteLogger: one write() and flush per line, without print()'s extra work.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(
        level=max(numeric, logging.WARNING), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
