"""Showing text the scheduler sent (task names, reasons, errors, event messages, table cells,
key descriptions) on a terminal so that the terminal shows it and never acts on it.

Every server-provided string the CLI prints goes through :func:`safe_text` (plain ``print``; log
lines through :class:`SafeLogText`) or :func:`markup` (``rich`` output, which also reads ``[...]`` as
style markup; its consoles are made with ``emoji=False``, so ``:smile:`` stays text). Control characters
(C0 and C1 controls, DEL, Unicode bidirectional overrides and line separators: the set
:func:`opentinker_common.spec.is_control_character` names, which the scheduler refuses in new
specs) are shown as escapes: ``ESC`` as ``\\x1b``, a newline as ``\\n``, U+202E as ``\\u202e``. So an
``ESC ] 0 ; ... BEL`` cannot retitle an admin's window or recolour the screen, and a newline in a
task name cannot forge a row of ``opentinker list``. Tasks stored before the scheduler refused
them, node notes and error texts from workers are shown the same way.
"""

from __future__ import annotations

import logging
from typing import Any

from opentinker_common.spec import is_control_character

__all__ = ["SafeLogText", "error_text", "markup", "safe_text"]

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(c: str) -> str:
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def safe_text(value: Any) -> str:
    """``str(value)`` with every control character written as an escape (``\\x1b``, ``\\n``,
    ``\\u202e``); text without any comes back unchanged."""
    text = value if isinstance(value, str) else str(value)
    if not any(is_control_character(c) for c in text):
        return text
    return "".join(_escaped(c) if is_control_character(c) else c for c in text)


def error_text(err: Any) -> str:
    """How the CLI words an error for a person: the message first, the gRPC status code last in
    brackets (``"spec.hyperparameters.stesp: expected one of the known keys (...); did you mean
    'steps'? [INVALID_ARGUMENT]"``), so the line reads as a sentence and the code is still there to
    search for. An error without a status code (a local one, ``TaskFailedError``) is its message.
    Scripts tell errors apart by the exit code (2), which does not change."""
    code = getattr(err, "code", None)
    details = getattr(err, "details", None)
    name = getattr(code, "name", None)
    if isinstance(details, str) and isinstance(name, str):
        return f"{details} [{name}]"
    return str(err)


def markup(value: Any) -> str:
    """:func:`safe_text`, then escaped for ``rich`` markup (``[red]`` in a name stays text)."""
    from rich.markup import escape

    return escape(safe_text(value))


class SafeLogText(logging.Filter):
    """A logging filter for the CLI's log handler: each record's message (which may quote the
    server, e.g. a pending task's reason) is rendered with :func:`safe_text`."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = safe_text(record.getMessage()), ()
        return True
