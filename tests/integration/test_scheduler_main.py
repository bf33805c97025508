"""``python -m opentinker_scheduler``: a bad port or a file given as the state folder stops it at
start with a one-line error, before it listens."""

from __future__ import annotations

import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "opentinker_scheduler", *args], capture_output=True, text=True, timeout=60
    )


def test_the_scheduler_refuses_bad_ports_and_a_file_as_state_dir(tmp_path) -> None:
    r = run("--port", "99999")
    assert r.returncode == 2 and "expected a port number 0-65535, got 99999" in r.stderr
    state = tmp_path / "file"
    state.write_text("x")
    r = run("--state-dir", str(state), "--port", "0", "--http-port", "0")
    assert r.returncode != 0 and f"state_dir {state}: not a folder" in (r.stderr + r.stdout)
