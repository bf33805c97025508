"""Wakes the WatchTask streams when tasks change.

A stream waits in :meth:`Changes.wait_changed`; whatever changes a task, a queue or a preemption
calls :meth:`Changes.notify`. Wake-ups are gathered: one per event-loop turn, however many
changes it made.
"""

from __future__ import annotations

import asyncio
import contextlib


class Changes:
    """The condition WatchTask streams wait on; call from the scheduler's event loop."""

    def __init__(self) -> None:
        self.changed = asyncio.Condition()
        self._watchers = 0  # streams waiting in wait_changed()
        self._wake_pending = False

    async def wait_changed(self, timeout: float) -> None:
        """Wait until some task changes (or ``timeout`` seconds pass)."""
        self._watchers += 1
        try:
            async with self.changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), timeout=timeout)
        finally:
            self._watchers -= 1

    def notify(self) -> None:
        """Wake waiting streams (once per loop turn, however many changes)."""
        if self._wake_pending or not self._watchers:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (unit tests of the core)
        self._wake_pending = True
        loop.create_task(self._wake())

    async def _wake(self) -> None:
        self._wake_pending = False
        async with self.changed:
            self.changed.notify_all()
