"""``scripts/demo.py`` run as a person runs it (``make demo``), its output read line by line, and
the processes whose command line names its ``--work-dir`` (the scheduler, trainer and worker it
starts in their own sessions)."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO = REPO_ROOT / "scripts" / "demo.py"


def free_port() -> int:
    # The demo needs PORT and PORT + 1 (HTTP); it moves to other free ones if they are taken.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def procs_naming(text: str) -> dict[int, str]:
    """Live (non-zombie) processes whose command line contains ``text``."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found[int(entry)] = cmdline
    return found


class Demo:
    def __init__(self, model: Path, work_dir: Path, *args: str, steps: int = 50) -> None:
        self.work_dir = work_dir
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-u",
                str(DEMO),
                "--model",
                str(model),
                "--work-dir",
                str(work_dir),
                "--port",
                str(free_port()),
                "--steps",
                str(steps),
                *args,
            ],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={k: v for k, v in os.environ.items() if k not in ("SCHEDULER_URL", "MAX_TASKS", "NODE_ID")},
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for_line(self, prefix: str, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line in {timeout:.0f} s:\n{''.join(self.output)}") from None
            if line is None:
                raise AssertionError(f"demo exited before printing {prefix!r}:\n{''.join(self.output)}")
            self.output.append(line)
            if line.startswith(prefix):
                return line

    def wait_for_worker(self, timeout: float = 90) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            workers = [
                pid for pid, cmd in procs_naming(str(self.work_dir)).items() if "opentinker_trainer.worker" in cmd
            ]
            if workers:
                return workers[0]
            assert self.proc.poll() is None, "demo exited before its worker started"
            time.sleep(0.1)
        raise AssertionError(f"no worker process in {timeout:.0f} s")

    def finish(self, timeout: float = 90) -> str:
        rc = self.proc.wait(timeout=timeout)
        while (line := self.lines.get(timeout=10)) is not None:
            self.output.append(line)
        return rc

    def kill_leftovers(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in procs_naming(str(self.work_dir)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def assert_nothing_left(work_dir: Path, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while (left := procs_naming(str(work_dir))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"
