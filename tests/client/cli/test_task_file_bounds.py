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


#: The CLI in a process of at most 2 GiB of address space, so a reader without a bound fails fast
#: instead of filling the machine's memory.
CAPPED_CLI = (
    "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); "
    "sys.argv[0] = 'opentinker'; runpy.run_module('opentinker_client', run_name='__main__')"
)


def capped_submit(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CAPPED_CLI, "--scheduler-url", "127.0.0.1:1", "submit", *args],
        capture_output=True,
        text=True,
        env=os.environ,
        timeout=600,
        cwd=tmp_path,
    )


def test_dev_zero_is_refused_after_its_first_mebibyte(tmp_path) -> None:
    done = capped_submit(tmp_path, "/dev/zero", "--dry-run")
    assert done.returncode == 2, done.stderr[-2000:]
    expected = "error: /dev/zero: expected a document of at most 1048576 bytes (max_bytes), got more [INVALID_ARGUMENT]"
    assert done.stderr == expected + "\n"


def test_a_fifo_is_read_no_further_than_the_limit(tmp_path) -> None:
    """A writer that would send 64 MiB into a FIFO: the CLI stops reading past 1 MiB and closes
    it, so the writer's next write fails (EPIPE) long before its end."""
    import threading

    fifo = tmp_path / "task.fifo"
    os.mkfifo(fifo)
    written = [0]

    def write() -> None:
        chunk = b"#" * (1 << 16)
        try:
            with open(fifo, "wb") as out:
                for _ in range(1024):
                    out.write(chunk)
                    written[0] += len(chunk)
        except BrokenPipeError:
            pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    done = capped_submit(tmp_path, str(fifo))
    writer.join(600)
    assert done.returncode == 2, done.stderr[-2000:]
    expected = f"error: {fifo}: expected a document of at most 1048576 bytes (max_bytes), got more [INVALID_ARGUMENT]"
    assert done.stderr == expected + "\n"
    assert written[0] < 8 << 20  # the CLI read 1 MiB and a byte, plus what the pipe buffers
