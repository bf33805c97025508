"""`opentinker submit` refuses a task file past the bounds of a user document (a YAML "billion
laughs", a document nested 10,000 levels deep, an alias inside itself, a file over 1 MiB) with
the file, line and column and the limit passed, and exits 2: no hang, no RecursionError
traceback. The CLI runs as its own process; the file is refused before any connection."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAD = "workload_type: lora_finetune\nmodel: org/m\nenv:\n  env_id: arithmetic\n"


def billion_laughs() -> str:
    """Ten levels of nine aliases each: 10**9 values once expanded, 1 KB as written."""
    lines = ['  l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 10):
        lines.append(f"  l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return HEAD + "hyperparameters:\n" + "\n".join(lines) + "\n"


def deep_flow(levels: int = 10_000) -> str:
    return HEAD + "  x: " + "[" * levels + "]" * levels + "\n"


def deep_block(levels: int = 10_000) -> str:
    """Block lists, one inside the other on one line: ``- - - ... 1``."""
    return HEAD + "  x:\n    " + "- " * levels + "1\n"


def submit(tmp_path: Path, text: str) -> subprocess.CompletedProcess:
    path = tmp_path / "task.yaml"
    path.write_text(text)
    # Nothing listens on port 1: a file that passed its checks would fail to connect instead.
    return subprocess.run(
        [sys.executable, "-m", "opentinker_client", "--scheduler-url", "127.0.0.1:1", "submit", str(path)],
        capture_output=True,
        text=True,
        env=os.environ,
        timeout=600,  # a hang guard: each refusal is immediate
        cwd=tmp_path,
    )


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        (billion_laughs(), "11:7", "expected at most 100000 values with aliases expanded (max_nodes), got more"),
        (
            deep_flow(),
            "5:68",
            "expected mappings and lists nested at most 64 levels deep (max_depth), got a deeper one",
        ),
        (
            deep_block(),
            "6:129",
            "expected mappings and lists nested at most 64 levels deep (max_depth), got a deeper one",
        ),
        (HEAD + "hyperparameters: &h\n  a: *h\n", "5:18", "expected aliases to earlier values, got one inside itself"),
        (HEAD + "name: " + "x" * (1 << 20) + "\n", None, "expected a document of at most 1048576 bytes (max_bytes)"),
    ],
    ids=["billion-laughs", "10k-deep-flow", "10k-deep-block", "recursive-alias", "over-1-MiB"],
)
def test_a_task_file_past_its_bounds_is_refused_with_its_place_and_limit(tmp_path, text, where, problem) -> None:
    done = submit(tmp_path, text)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "RecursionError" not in done.stderr
    path = tmp_path / "task.yaml"
    at = f"{path}:{where}: " if where else f"{path}: "
    assert f"error: {at}{problem}" in done.stderr, done.stderr[-2000:]
    assert "127.0.0.1:1" not in done.stderr  # refused before any connection


def test_aliases_within_the_bounds_still_work(tmp_path) -> None:
    text = HEAD + "hyperparameters:\n  steps: &n 3\n  group_size: *n\n"
    done = submit(tmp_path, text)
    assert "max_nodes" not in done.stderr and "127.0.0.1:1" in done.stderr  # read, then the connection failed
