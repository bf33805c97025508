"""Server-streaming plumbing: a blocking iterator (file or store reads) read in a thread, a batch
at a time, the next batch while this one is sent."""

from __future__ import annotations

import asyncio
import itertools
from typing import AsyncIterator, Iterator, TypeVar

__all__ = ["READ_AHEAD_BATCH", "read_ahead"]

T = TypeVar("T")

#: Items (1 MiB chunks) read per trip to a thread: one hop per chunk costs more than the read.
READ_AHEAD_BATCH = 8


async def read_ahead(items: Iterator[T], batch: int = READ_AHEAD_BATCH) -> AsyncIterator[T]:
    """The items of the blocking iterator ``items``, in order, read ``batch`` at a time in a
    thread; the next batch is read while the caller consumes this one (at most two batches held).
    An error of ``items`` is raised where its item would have come. When the caller stops early,
    a read in flight is waited for (``items`` is never touched by two threads)."""

    def read() -> list[T]:
        return list(itertools.islice(items, batch))

    ahead: asyncio.Future | None = asyncio.ensure_future(asyncio.to_thread(read))
    try:
        while ahead is not None:
            got = await ahead
            ahead = asyncio.ensure_future(asyncio.to_thread(read)) if len(got) == batch else None
            for item in got:
                yield item
    finally:
        if ahead is not None and not ahead.done():
            await asyncio.gather(ahead, return_exceptions=True)
