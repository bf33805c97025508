"""``python -m opentinker_scheduler``: a bad port, a file given as the state folder or an S3
artifact store that does not answer stops it at start with an error, before it listens."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.procs import free_port


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


def test_the_scheduler_refuses_to_start_when_its_s3_store_is_unreachable(tmp_path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config = tmp_path / "scheduler.yaml"
    config.write_text(f"artifacts: {{backend: s3, s3: {{endpoint: '{endpoint}', bucket: ckpt}}}}\n")
    secret = "s3cr3t-never-echoed-7731"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "AKIAOPENTINKER", "AWS_SECRET_ACCESS_KEY": secret}
    r = subprocess.run(
        [sys.executable, "-m", "opentinker_scheduler", "--config", str(config), "--state-dir", str(tmp_path / "s")]
        + ["--port", "0", "--http-port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    out = r.stderr + r.stdout
    assert r.returncode != 0 and f"S3 endpoint {endpoint} unreachable" in out, out
    assert secret not in out
