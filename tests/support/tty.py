"""Running the `opentinker` CLI with its stdout on a pseudo-terminal: what a person sees (the
progress bar), with colours and cursor moves taken out."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time


def run_on_tty(args: list[str], *, env: dict[str, str], timeout: float = 60) -> tuple[int, str]:
    """Run ``python -m opentinker_client ARGS`` with stdout on a pseudo-terminal; (rc, output)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "opentinker_client", *args],
        stdout=slave,
        stderr=subprocess.PIPE,
        env={**env, "TERM": "xterm-256color"},
    )
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
    rc = proc.wait(timeout=10)
    text = b"".join(chunks).decode(errors="replace")
    return rc, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)  # colours and cursor moves off
