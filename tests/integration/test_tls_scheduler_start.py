"""``python -m opentinker_scheduler`` with a ``tls:`` key of another certificate exits 2 with one
line naming the config key, before it listens. (The config checks themselves, in-process:
tests/scheduler/security/test_tls_config.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.security import make_certs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def certs(tmp_path):
    return make_certs(tmp_path / "certs")


def test_the_scheduler_exits_2_with_one_line_for_a_mismatched_pair(tmp_path, certs) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"state_dir: {tmp_path / 'state'}\ntls: {{cert: certs/server.pem, key: certs/node.key}}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "opentinker_scheduler", "--config", str(config), "--port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1
        and lines[0].startswith("error: ")
        and "tls.key: expected the private key of tls.cert" in lines[0]
    ), proc.stderr
    assert "KEY_VALUES_MISMATCH" in lines[0] and "cannot listen" not in proc.stderr
