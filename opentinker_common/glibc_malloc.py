"""glibc heap settings for a whole process. Only process entry points call :func:`tune_malloc`,
each with the reason its process needs what it asks for.

Two settings, each for one kind of process:

- ``stream_buffers``: a process that streams artifacts in 1 MiB chunks (the scheduler, a task
  worker). Each chunk passes through several fresh buffers: the file read, the protobuf message,
  its serialization, gRPC's slices. With glibc's defaults each is often new memory from the
  kernel, so every 4 KiB page costs a page fault and zeroing. Allocations up to
  :data:`MMAP_THRESHOLD_BYTES` then come from the heap, and up to :data:`TRIM_THRESHOLD_BYTES`
  of freed heap is kept, so the buffers are reused. ``make bench-store`` measures the gain.
- ``max_arenas``: a process whose threads take turns on one model (the model host). glibc gives
  each allocating thread its own arena, up to 8 per core, and memory freed in one arena is not
  reused by another, so each tenant thread would keep a step's activations resident.
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["KEEP_MALLOC_ENV", "MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "tune_malloc"]

#: With ``stream_buffers``, allocations up to this size (4 MiB) come from the heap.
MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024
#: With ``stream_buffers``, freed memory at the top of a heap is kept up to this much (32 MiB).
TRIM_THRESHOLD_BYTES = 32 * 1024 * 1024
#: Set to anything to keep glibc's own settings.
KEEP_MALLOC_ENV = "OPENTINKER_KEEP_MALLOC"

# mallopt(3) parameter numbers, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def tune_malloc(*, stream_buffers: bool = False, max_arenas: int | None = None, env=None) -> bool:
    """Apply the settings asked for, as the module docstring says, with ``mallopt``.

    Leaves the process as it is on another C library or with ``OPENTINKER_KEEP_MALLOC`` set. A
    setting whose ``MALLOC_*`` variable the operator set is left to glibc, which reads it, so the
    operator's choice wins; for ``stream_buffers`` either of its two variables counts.
    ``stream_buffers`` costs at most :data:`TRIM_THRESHOLD_BYTES` of freed memory kept per arena.

    Args:
        stream_buffers: reuse the buffers of large streamed messages.
        max_arenas: cap glibc's malloc arenas at this many (at least 1).
        env: the environment to read, ``os.environ`` by default.

    Returns:
        Whether every setting asked for was applied.

    Raises:
        ValueError: ``max_arenas`` is below 1.
    """
    if max_arenas is not None and max_arenas < 1:
        raise ValueError(f"max_arenas: expected an integer >= 1, got {max_arenas}")
    env = os.environ if env is None else env
    if KEEP_MALLOC_ENV in env or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # Each group of settings is left alone when the operator set one of its variables.
    groups: list[tuple[tuple[str, ...], list[tuple[int, int]]]] = []
    if stream_buffers:
        # The mmap threshold first: setting it also stops glibc from moving either threshold itself.
        groups.append(
            (
                ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"),
                [(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)],
            )
        )
    if max_arenas is not None:
        groups.append((("MALLOC_ARENA_MAX",), [(_M_ARENA_MAX, int(max_arenas))]))
    applied = True
    for variables, settings in groups:
        if any(v in env for v in variables):
            applied = False
            continue
        for param, value in settings:
            applied = bool(mallopt(param, value)) and applied
    return applied
