"""Heap settings for processes that stream large gRPC messages (artifact uploads and downloads).

Every 1 MiB chunk of an artifact stream passes through several fresh buffers (the file read,
the protobuf message, its serialization, gRPC's slices). With glibc's defaults each such buffer
is often new memory from the kernel (an ``mmap``, or heap given back by trimming and taken again),
so every 4 KiB page of every chunk costs a page fault and zeroing: on the 2-core dev machine that
was about half of what an empty ``DownloadArtifact`` stream costs (``make bench-store``:
427 -> 950-980 MB/s for 540 MB; the store's own read 237 -> 350-360 MB/s; BENCHMARKS.md).

:func:`reuse_stream_buffers` makes glibc serve allocations up to :data:`MMAP_THRESHOLD_BYTES`
from the heap and keep up to :data:`TRIM_THRESHOLD_BYTES` of freed heap, so those buffers are
reused. The scheduler and every task worker call it at start.
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["KEEP_MALLOC_ENV", "MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "reuse_stream_buffers"]

#: Allocations up to this size (4 MiB) come from the heap, not from their own ``mmap``.
MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024
#: Freed memory at the top of a heap is kept up to this much (32 MiB) before it is given back.
TRIM_THRESHOLD_BYTES = 32 * 1024 * 1024

# mallopt(3) parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
#: Set (to anything) to keep glibc's own settings.
KEEP_MALLOC_ENV = "OPENTINKER_KEEP_MALLOC"


def reuse_stream_buffers(env=None) -> bool:
    """Set glibc's mmap and trim thresholds (``mallopt``) as the module docstring says.

    Leaves the process as it is, returning False, on another C library, with
    ``OPENTINKER_KEEP_MALLOC`` set, or when the operator set ``MALLOC_MMAP_THRESHOLD_`` or
    ``MALLOC_TRIM_THRESHOLD_`` (their choice wins). Costs at most
    :data:`TRIM_THRESHOLD_BYTES` of freed memory kept per heap arena.

    Returns:
        Whether both settings were applied.
    """
    env = os.environ if env is None else env
    if any(k in env for k in (*_ENV, KEEP_MALLOC_ENV)) or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # the mmap threshold first: setting it also stops glibc from moving either threshold itself
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
