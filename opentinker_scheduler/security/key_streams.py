"""Streams opened with an API key end when the key stops being valid.

A trainer node's ``NodeService.Connect`` stream and a client's ``WatchTask`` stream live for hours;
a key checked only when they open would let a revoked key keep a node attached (receiving task
specs) or keep reading a task's events. The :class:`~opentinker_scheduler.security.auth.AuthInterceptor`
registers every stream it admits with a key here (by key prefix, which names one key hash), and
ends it with ``UNAUTHENTICATED`` and the key-check message (``API key otk_1a2b3c4d was revoked``):

* **at once** when ``AdminService`` revokes the key, or rotates it without a grace period
  (:meth:`KeyStreams.end_key`);
* **within** ``auth.stream_recheck_interval`` **seconds** (default 5) of the key expiring (the end
  of a rotation's grace period; a timer set at the rotation fires at the end of the grace too) or
  being revoked by any other path: while streams are open, a background task re-reads each of
  their keys (one SQLite primary-key read per key per interval) and ends the streams of keys that
  no longer resolve.

Ending a stream cancels its handler the way a client cancellation does, so the handler's
``finally`` blocks run (a node's disconnect handling, the stream slot of ``max_streams_per_owner``),
and the call then ends with ``UNAUTHENTICATED``. The trainer node agent treats that status as a
refusal and exits 1 (``scheduler refused this node``), as it does when its key is refused at
``Register``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterable, AsyncIterator, Awaitable, Callable, TypeVar

import structlog

log = structlog.get_logger("opentinker.scheduler")

T = TypeVar("T")

#: Seconds between re-checks of the keys of open streams, unless configured.
DEFAULT_RECHECK_INTERVAL_S = 5.0


class OpenStream:
    """One open stream admitted with API key ``prefix``; :attr:`ended` is set when the key is no
    longer valid, with the reason in :attr:`reason`."""

    __slots__ = ("prefix", "method", "peer", "ended", "reason")

    def __init__(self, prefix: str, method: str, peer: str) -> None:
        self.prefix, self.method, self.peer = prefix, method, peer
        self.ended = asyncio.Event()
        self.reason = ""

    def end(self, reason: str) -> None:
        if not self.ended.is_set():
            self.reason = reason
            self.ended.set()


class KeyStreams:
    """Open streams by API key prefix, on the server's event loop (not thread-safe).

    Args:
        refusal: ``prefix -> reason | None``: why the key may no longer be used, re-read from the
            key store (:meth:`opentinker_scheduler.security.keys.KeyStore.refusal`).
        recheck_interval_s: seconds between re-checks while streams are open (> 0).
    """

    def __init__(
        self, refusal: Callable[[str], str | None], *, recheck_interval_s: float = DEFAULT_RECHECK_INTERVAL_S
    ) -> None:
        if not recheck_interval_s > 0:
            raise ValueError(f"recheck_interval_s: expected seconds > 0, got {recheck_interval_s!r}")
        self._refusal = refusal
        self.recheck_interval_s = float(recheck_interval_s)
        self._open: dict[str, set[OpenStream]] = {}
        self._watcher: asyncio.Task | None = None

    # ------------------------------------------------------------------ registry
    def open(self, prefix: str, method: str = "", peer: str = "") -> OpenStream:
        """Register a stream of key ``prefix``; pair with :meth:`close`."""
        stream = OpenStream(prefix, method, peer)
        self._open.setdefault(prefix, set()).add(stream)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch(), name="key-streams-recheck")
        return stream

    def close(self, stream: OpenStream) -> None:
        streams = self._open.get(stream.prefix)
        if streams is not None:
            streams.discard(stream)
            if not streams:
                del self._open[stream.prefix]
        if not self._open and self._watcher is not None:
            self._watcher.cancel()  # nothing to watch; the next open() starts a new one
            self._watcher = None

    def count(self, prefix: str | None = None) -> int:
        """Open streams of key ``prefix`` (all keys when None)."""
        if prefix is not None:
            return len(self._open.get(prefix, ()))
        return sum(len(s) for s in self._open.values())

    # ------------------------------------------------------------------ ending
    def end_key(self, prefix: str, reason: str) -> int:
        """End every open stream of key ``prefix`` with ``reason``; returns how many."""
        streams = list(self._open.get(prefix, ()))
        for s in streams:
            s.end(reason)
        if streams:
            log.info("streams of a key ended", key_prefix=prefix, streams=len(streams), reason=reason)
        return len(streams)

    def recheck(self) -> int:
        """Re-read the key of every open stream now; end those of keys that no longer resolve.
        Returns the number of streams ended."""
        ended = 0
        for prefix in list(self._open):
            reason = self._refusal(prefix)
            if reason is not None:
                ended += self.end_key(prefix, reason)
        return ended

    def recheck_after(self, delay_s: float) -> None:
        """Re-check once ``delay_s`` seconds from now (the end of a rotation's grace period)."""
        loop = asyncio.get_running_loop()
        loop.call_later(max(0.0, delay_s), self._recheck_logged)

    def _recheck_logged(self) -> None:
        try:
            self.recheck()
        except Exception:  # noqa: BLE001 - a store hiccup: the next re-check tries again
            log.exception("re-checking the keys of open streams failed")

    async def _watch(self) -> None:
        while self._open:
            await asyncio.sleep(self.recheck_interval_s)
            self._recheck_logged()


async def until_ended(source: AsyncIterable[T], stream: OpenStream) -> AsyncIterator[T]:
    """Yield the items of ``source`` until it ends or ``stream`` is ended, whichever is first.

    When the stream is ended first, the pending ``__anext__`` of ``source`` is cancelled (a handler
    generator sees ``CancelledError`` at its ``await`` and runs its ``finally`` blocks) and
    ``source`` is closed; the caller then looks at ``stream.ended``. Exceptions of ``source``
    (including a handler's ``context.abort``) propagate unchanged.
    """
    it = source.__aiter__()
    ended = asyncio.ensure_future(stream.ended.wait())
    pending: asyncio.Future | None = None
    try:
        while True:
            pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait((pending, ended), return_when=asyncio.FIRST_COMPLETED)
            if pending not in done:
                return  # the key was revoked or expired: finally cancels the handler
            nxt, pending = pending, None
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        ended.cancel()
        if pending is not None:
            if not pending.done():
                pending.cancel()
                await asyncio.wait((pending,))  # let the handler's finally blocks run to the end
            if not pending.cancelled() and pending.exception() is not None:
                log.debug("stream handler ended with an error while being closed", error=repr(pending.exception()))
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(RuntimeError):  # already closed or finished
                await aclose()


async def await_until_ended(call: Awaitable[T], stream: OpenStream) -> tuple[bool, T | None]:
    """Await ``call`` (a handler of a client-streaming RPC) unless ``stream`` is ended first.

    Returns ``(True, result)``, or ``(False, None)`` after cancelling ``call`` when the stream
    was ended.
    """
    task = asyncio.ensure_future(call)
    ended = asyncio.ensure_future(stream.ended.wait())
    try:
        await asyncio.wait((task, ended), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return True, task.result()
        task.cancel()
        await asyncio.wait((task,))
        return False, None
    finally:
        ended.cancel()
        if not task.done():  # we were cancelled ourselves
            task.cancel()
