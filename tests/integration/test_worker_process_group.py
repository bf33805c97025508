"""Workers die with their node agent: ``die_with_parent`` (PR_SET_PDEATHSIG + parent check)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from opentinker_trainer._proc import AGENT_PID_ENV

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")

# The child: arms the death signal, says so with its pid, then sleeps.
CHILD = textwrap.dedent(
    """
    import sys, time
    from opentinker_trainer._proc import die_with_parent
    armed = die_with_parent()
    print("armed" if armed else "unarmed", flush=True)
    time.sleep(60)
    """
)

# The parent (stands in for the node agent): starts the child with its pid in the environment
# the way the agent does, prints the child's pid and its report, then sleeps.
PARENT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    env = {**os.environ, %r: str(os.getpid())}
    child = subprocess.Popen(
        [sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    print(child.pid, child.stdout.readline().strip(), flush=True)
    time.sleep(60)
    """
    % AGENT_PID_ENV
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def env_without_agent_pid() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != AGENT_PID_ENV}


@linux_only
def test_child_dies_when_parent_is_killed():
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True, env=env_without_agent_pid()
    )
    child_pid = None
    try:
        line = parent.stdout.readline().split()
        assert len(line) == 2 and line[1] == "armed", line
        child_pid = int(line[0])
        assert alive(child_pid)
        parent.kill()  # kill -9: no clean-up in the parent
        parent.wait(timeout=10)
        deadline = time.monotonic() + 5
        while alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child_pid), "the child outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child_pid is not None and alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_exits_at_once_when_parent_already_changed():
    """The spawner died before the death signal was armed: the child was re-parented, its
    parent is no longer OPENTINKER_AGENT_PID, so it exits instead of running orphaned."""
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        env={**os.environ, AGENT_PID_ENV: "999999999"},  # certainly not our pid
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "parent process 999999999 is gone" in proc.stderr


def test_keeps_running_under_the_expected_parent():
    proc = subprocess.run(
        [sys.executable, "-c", "from opentinker_trainer._proc import die_with_parent; die_with_parent(); print('ran')"],
        env={**os.environ, AGENT_PID_ENV: str(os.getpid())},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ran", proc.stderr
    # Without the variable there is nothing to compare with; it still runs.
    proc = subprocess.run(
        [sys.executable, "-c", "from opentinker_trainer._proc import die_with_parent; die_with_parent(); print('ran')"],
        env=env_without_agent_pid(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ran", proc.stderr


@linux_only
def test_worker_module_arms_the_death_signal(tmp_path):
    """``python -m opentinker_trainer.worker`` calls die_with_parent before anything else: with a
    stale agent pid it exits at once (before it even reads its assignment file)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "opentinker_trainer.worker",
            str(tmp_path / "missing.pb"),
            "--checkpoint-dir",
            str(tmp_path),
        ],
        env={**os.environ, AGENT_PID_ENV: "999999999"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "parent process 999999999 is gone" in proc.stderr
    assert "Traceback" not in proc.stderr
