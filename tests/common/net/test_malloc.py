"""glibc heap settings for processes streaming artifacts: applied by default, never over the
operator's own MALLOC_* settings or OPENTINKER_KEEP_MALLOC. The gain is measured by
``make bench-store`` (``--default-malloc`` runs without them), not here."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from opentinker_common.net.malloc import KEEP_MALLOC_ENV, reuse_stream_buffers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _in_fresh_process(env: dict[str, str]) -> str:
    """What ``reuse_stream_buffers()`` returns in a new interpreter with ``env`` added."""
    code = "from opentinker_common.net.malloc import reuse_stream_buffers as r; print(r())"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != KEEP_MALLOC_ENV}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**clean, "PYTHONPATH": ROOT, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_applied_unless_the_operator_chose_otherwise() -> None:
    assert _in_fresh_process({}) == "True"
    assert _in_fresh_process({"MALLOC_MMAP_THRESHOLD_": "262144"}) == "False"
    assert _in_fresh_process({"MALLOC_TRIM_THRESHOLD_": "262144"}) == "False"
    assert _in_fresh_process({KEEP_MALLOC_ENV: "1"}) == "False"


def test_another_c_library_is_left_alone(monkeypatch) -> None:
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert reuse_stream_buffers(env={}) is False
