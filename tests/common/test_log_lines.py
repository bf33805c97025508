"""Console log lines (a scheduler or trainer run on a terminal) show control characters in logged
values as escapes, so text a client or node sent cannot act on the operator's terminal; JSON lines
keep the exact value (JSON escapes it). Each case runs in a fresh Python: logging is set up once per
process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NODE_ID = "rack\x1b]0;PWNED\x07"  # no space: the renderer would show it as it is
ERROR = "worker said \x1b[2J\nforged line \u202e"  # shown with repr()
PROGRAM = f"""
import structlog
from opentinker_common.logs import configure_logging
configure_logging(json={{json}})
log = structlog.get_logger("t")
log.info("node refused", node_id={NODE_ID!r}, error={ERROR!r})
log.info("event text \x1b[31mred")
try:
    raise ValueError("boom \x1b]0;PWNED2\x07")
except ValueError:
    log.exception("failed")
"""


def _stderr(as_json: bool) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "protos")])}
    env.pop("OPENTINKER_LOG_FORMAT", None)
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM.format(json=as_json)], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_console_lines_escape_control_characters_and_keep_tracebacks() -> None:
    err = _stderr(False)
    assert "node_id" in err and "rack\\x1b]0;PWNED\\x07" in err
    assert "worker said \\x1b[2J\\nforged line \\u202e" in err and "event text \\x1b[31mred" in err
    assert "boom \\x1b]0;PWNED2\\x07" in err  # in the traceback too ...
    assert "Traceback (most recent call last):\n" in err  # ... which keeps its lines
    for raw in ("\x1b]0;", "\x07", "\u202e", "\x1b[2J", "\x1b[31mred"):
        assert raw not in err, raw
    assert not any(line.startswith("forged") for line in err.splitlines())


def test_json_lines_keep_the_exact_value() -> None:
    (first, *_) = [json.loads(line) for line in _stderr(True).splitlines() if line.startswith("{")]
    assert (first["node_id"], first["error"]) == (NODE_ID, ERROR)
