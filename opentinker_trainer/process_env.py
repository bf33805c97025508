"""The environment a node agent starts a worker or a model host with, for how it uses the CPU.

:func:`process_env` is the part of a child's environment that decides how it runs on the node's
cores: torch's intra-op threads (``OMP_NUM_THREADS``, :func:`intra_op_threads`), OpenMP's wait
policy, tokenizers' threads and progress bars. The agent adds the task's own settings on top
(scheduler link, devices, work folder). ``scripts/bench_multitenant.py`` starts its processes
with it too, so what it measures is what a node runs. Torch-free.

Every setting is a default: one the operator set in the agent's environment is kept.
"""

from __future__ import annotations

import os
from typing import Mapping

__all__ = ["HOST", "WORKER", "cpu_cores", "intra_op_threads", "process_env"]

#: The two kinds of process a node agent starts.
WORKER = "worker"
HOST = "host"


def cpu_cores() -> int:
    """CPU cores this process may run on: its affinity mask, else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def intra_op_threads(role: str, *, cores: int, max_tasks: int) -> int:
    """Torch intra-op threads of a ``role`` process on a node of ``cores`` cores that runs up to
    ``max_tasks`` tasks.

    Raises:
        ValueError: ``role`` is neither :data:`HOST` nor :data:`WORKER`.
    """
    if role == HOST:
        # The host is the one process that holds the model for every tenant of the node, one turn at a time.
        return max(1, cores)
    if role == WORKER:
        # A worker is one of up to max_tasks tasks of the node: its share, so a full node runs one thread per core.
        return max(1, cores // max(1, max_tasks))
    raise ValueError(f"role: expected {HOST!r} or {WORKER!r}, got {role!r}")


def process_env(base: Mapping[str, str], *, role: str, max_tasks: int, cores: int | None = None) -> dict[str, str]:
    """``base`` with the CPU settings of a ``role`` process added where ``base`` lacks them.

    Args:
        base: the agent's environment, or what a caller starts from.
        role: :data:`HOST` or :data:`WORKER`.
        max_tasks: the most tasks the node runs at once (the agent's ``--max-tasks``).
        cores: the node's cores; :func:`cpu_cores` when None.

    Raises:
        ValueError: ``role`` is neither :data:`HOST` nor :data:`WORKER`.
    """
    env = dict(base)
    threads = intra_op_threads(role, cores=cpu_cores() if cores is None else cores, max_tasks=max_tasks)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    # OpenMP threads that wait for work sleep instead of spinning. A spinning thread burns a
    # core; on a node whose cores are all busy (several tasks, a model host's tenants) the
    # thread it waits for then runs late, and each parallel op waits a scheduler time slice.
    # A CPU-bound task's steps took 5 to 10 times longer so, depending on which of its threads
    # had started the spinning.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Workers share the agent's stderr: a progress bar's "\r" redraw (transformers' "Loading
    # weights") would glue another worker's log line onto its own, unreadable as JSON.
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return env
