"""read_ahead: a blocking iterator's items in order across batches, its error where its item
would have come, and no read left running when the consumer stops early."""

from __future__ import annotations

import asyncio
import threading

import pytest

from opentinker_scheduler.api.streams import read_ahead


def test_items_in_order_then_the_error_where_it_happened() -> None:
    def items():
        yield from range(10)
        raise OSError("disk gone")

    async def main() -> list[int]:
        got = []
        with pytest.raises(OSError, match="disk gone"):
            async for x in read_ahead(items(), batch=3):
                got.append(x)
        return got

    assert asyncio.run(main()) == list(range(9))  # the batch holding the failing read is not sent


def test_stopping_early_waits_for_the_read_in_flight() -> None:
    reading = threading.Event()
    release = threading.Event()
    done: list[str] = []

    def items():
        yield 0
        reading.set()
        release.wait(10)
        done.append("read")
        yield 1

    async def main() -> None:
        gen = read_ahead(items(), batch=1)
        assert await gen.__anext__() == 0
        await asyncio.to_thread(reading.wait, 10)  # the next batch is being read meanwhile
        threading.Timer(0.05, release.set).start()
        await gen.aclose()
        assert done == ["read"]  # aclose returned only after that read had finished

    asyncio.run(main())
