"""Process helpers for worker processes (no torch, no gRPC: importable from anywhere)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

__all__ = ["AGENT_PID_ENV", "die_with_parent"]

#: The node agent sets this to its own pid in the environment of every worker it starts.
AGENT_PID_ENV = "OPENTINKER_AGENT_PID"

_PR_SET_PDEATHSIG = 1


def _set_pdeathsig(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``; False when not on Linux or the call fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` (default SIGKILL) to this process when its parent dies.

    A worker must not outlive its node agent: after ``kill -9`` of the agent nobody reads the
    worker's reports or stops it, and it would hold its GPUs until it next writes to the closed
    pipe. On Linux this sets ``PR_SET_PDEATHSIG``; elsewhere it does nothing and returns False.

    The parent may have died between spawning us and this call, before the death signal was
    armed: then we have been re-parented and ``os.getppid()`` is no longer the spawner's pid.
    ``expected_parent`` is that pid (default: the ``OPENTINKER_AGENT_PID`` environment variable,
    when set and valid); if the parent has already changed, the process exits at once
    (``os._exit(1)``, no clean-up: there is no one to clean up for).

    Note: the death signal fires when the *thread* that forked us ends, and is cleared by
    ``execve`` of a set-uid binary; spawn workers from the agent's main thread.

    Returns:
        True when the death signal is armed.
    """
    if expected_parent is None:
        text = os.environ.get(AGENT_PID_ENV, "").strip()
        expected_parent = int(text) if text.isdigit() and int(text) > 0 else None
    armed = _set_pdeathsig(sig)
    if expected_parent is not None and os.getppid() != expected_parent:
        try:
            os.write(2, f"parent process {expected_parent} is gone (parent is now {os.getppid()}); exiting\n".encode())
        except OSError:
            pass
        os._exit(1)
    return armed
