"""An asyncio event loop running in a thread of its own, for in-process schedulers in a test."""

from __future__ import annotations

import asyncio
import threading


class LoopThread:
    """An event loop in a daemon thread; :meth:`call` runs a coroutine on it and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
