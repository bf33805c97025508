"""glibc heap settings: applied by default, never over the operator's own MALLOC_* settings or
OPENTINKER_KEEP_MALLOC; called from process entry points only. The gain of ``stream_buffers`` is
measured by ``make bench-store`` (``--default-malloc`` runs without it), not here."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from opentinker_common.glibc_malloc import KEEP_MALLOC_ENV, tune_malloc

ROOT = Path(__file__).resolve().parents[2]

#: The process entry points, each a ``main`` that a console script or ``python -m`` runs.
ENTRY_POINTS = {
    "opentinker_scheduler/__main__.py",
    "opentinker_trainer/worker.py",
    "opentinker_trainer/host.py",
}


def _in_fresh_process(env: dict[str, str], call: str) -> str:
    """What ``tune_malloc(<call>)`` returns in a new interpreter with ``env`` added."""
    code = f"from opentinker_common.glibc_malloc import tune_malloc; print(tune_malloc({call}))"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != KEEP_MALLOC_ENV}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**clean, "PYTHONPATH": str(ROOT), **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_applied_unless_the_operator_chose_otherwise() -> None:
    assert _in_fresh_process({}, "stream_buffers=True") == "True"
    assert _in_fresh_process({}, "max_arenas=2") == "True"
    assert _in_fresh_process({"MALLOC_MMAP_THRESHOLD_": "262144"}, "stream_buffers=True") == "False"
    assert _in_fresh_process({"MALLOC_TRIM_THRESHOLD_": "262144"}, "stream_buffers=True") == "False"
    assert _in_fresh_process({"MALLOC_ARENA_MAX": "4"}, "max_arenas=2") == "False"
    assert _in_fresh_process({"MALLOC_ARENA_MAX": "4"}, "stream_buffers=True") == "True"
    assert _in_fresh_process({KEEP_MALLOC_ENV: "1"}, "max_arenas=2") == "False"


def test_another_c_library_is_left_alone(monkeypatch) -> None:
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert tune_malloc(stream_buffers=True, env={}) is False


def test_a_cap_below_one_arena_is_refused() -> None:
    with pytest.raises(ValueError, match="max_arenas: expected an integer >= 1, got 0"):
        tune_malloc(max_arenas=0, env={})


def test_process_tuning_happens_in_entry_points_only() -> None:
    """Heap and interpreter settings are the process's, not a library's: a module that changes
    them on import or in a constructor changes every program that uses it."""
    tuning = re.compile(r"\b(tune_malloc|mallopt|setswitchinterval|gc\.freeze)\(")
    found = set()
    for package in ("opentinker_common", "opentinker_scheduler", "opentinker_trainer", "opentinker_client"):
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel != "opentinker_common/glibc_malloc.py" and tuning.search(path.read_text(encoding="utf-8")):
                found.add(rel)
    assert found == ENTRY_POINTS
    for rel in ENTRY_POINTS:
        text = (ROOT / rel).read_text(encoding="utf-8")
        main = text[text.index("\ndef main(") :]
        calls = [line for line in text.splitlines() if tuning.search(line)]
        assert calls and all(line in main for line in calls), f"{rel}: tuning outside main()"
        assert all("#" in line for line in calls), f"{rel}: each tuning call says its reason"
