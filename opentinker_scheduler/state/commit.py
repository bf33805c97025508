"""Group commit: the writes of many requests in one store transaction, nothing released early.

One commit costs far more than the statements in it (its pages go to the WAL), and a task's
life is four writes (submitted, assigned, running, finished), so a busy scheduler spent most of
its store time committing. With group commit on, the first write after a commit opens a
transaction; it commits on the next event-loop turn, or, when the previous commit was less than
``interval_s`` ago, that long after it, so under load one commit carries every write of a few
milliseconds.

The rule "every transition is written to the store before it is acknowledged or pushed" holds:
node commands wait in :meth:`hold` until the commit, and RPC handlers await :meth:`durable`
before they answer. If a commit fails, ``on_failure`` rebuilds memory from the store, the held
commands are dropped and every waiter gets the error. Off (unit tests, or no running loop),
every write commits at once.

A backend may commit a group without the event loop waiting for it (PostgreSQL: the group's
COMMIT goes out from a thread of its own: :meth:`~.store.StateStore.flush_pending`). The group's
waiters and held commands are then released once it is durable, in commit order, while the loop
goes on gathering the next group, whose own commit waits until that one has ended
(:meth:`~.store.StateStore.commit_in_flight`). A failure there is handled as a failed commit, and
the group opened since then, built on it, is abandoned first. So the loop never sits in a COMMIT,
and "durable before acknowledged" still holds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from typing import Callable

import structlog

from opentinker_scheduler.state.store import StateStore

log = structlog.get_logger("opentinker.scheduler")

#: At most one commit per this many seconds under load (the added latency, at most). 5 ms, not 2:
#: at ~500 submits/s a commit then carries ~10 writes instead of ~5, for ~5 % less CPU per submit.
GROUP_COMMIT_INTERVAL_S = 0.005
#: Under load the window also grows to what the recent commits took (a PostgreSQL commit waits
#: for its WAL flush, several ms on a slow disk; the next group then gathers as many requests as
#: arrived meanwhile instead of committing each alone), up to this.
GROUP_COMMIT_MAX_WINDOW_S = 0.025


class GroupCommit:
    def __init__(
        self, store: StateStore, on_failure: Callable[[], None], interval_s: float = GROUP_COMMIT_INTERVAL_S
    ) -> None:
        self.store = store
        self.on_failure = on_failure
        self.interval_s = interval_s
        self.commits = 0  # how many group commits (for tests and profiling)
        self._tx = None  # the open transaction
        self._done: asyncio.Future | None = None  # resolved when it commits
        self._held: list[tuple[asyncio.Queue, object]] = []
        #: ``id(outbox) -> index`` in ``_held`` of that outbox's cumulative command in the open group.
        self._cumulative: dict[int, int] = {}
        self._last = 0.0  # loop time of the last commit
        self._commit_s = 0.0  # recent commits' duration (moving average), seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Groups committed but not yet durable (their flush is running), oldest first:
        #: ``[done future, held commands]``; released by :meth:`_flushed` in this order.
        self._unflushed: list[list] = []
        self.enabled = False
        self._prepared = False  # the open group's before_commit calls ran (one loop turn ago)
        self._prepare_s = 0.0  # how long they took, seconds
        #: :meth:`before_commit` calls of the open group.
        self._before_commit: list[Callable[[], None]] = []
        self._opened = 0  # groups opened so far (the open one's number)
        #: The open group's window ended while the previous group's commit still ran off the
        #: loop: :meth:`_flushed` commits it once that one has ended.
        self._due_waiting = False
        #: A ``before_commit`` call's ``(future, then)`` whose answer the open group waits for.
        self._awaiting: tuple | None = None

    def enable(self) -> None:
        self.enabled = True
        self.store.before_write = self.open

    def group(self) -> asyncio.Future | None:
        """The open group's future (opening one), resolved once it is committed and durable, or
        failed with the commit's error; None when writes commit at once (group commit off, or no
        running loop)."""
        if not self.enabled:
            return None
        self.open()
        return self._done

    def before_commit(self, call: Callable[[], None]) -> None:
        """Have the open group (:meth:`group`) call ``call`` once when it commits, before its
        transaction ends, so what ``call`` writes joins the group (a group's new tasks, written
        in one statement: :meth:`~.client_api.ClientApi.submit_grouped`). If it raises, the group fails
        as a failed commit does; a group abandoned (:meth:`abandon`) never calls it."""
        self._before_commit.append(call)

    @property
    def open_now(self) -> bool:
        return self._tx is not None

    def open(self) -> None:
        """Called before every write: joins the open transaction or opens one."""
        if self._tx is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: the write commits on its own
        tx = self.store.transaction(flush_behind=True)
        tx.__enter__()
        self._opened += 1
        self._loop, self._tx, self._done = loop, tx, loop.create_future()
        window = max(self.interval_s, min(self._commit_s, GROUP_COMMIT_MAX_WINDOW_S))
        wait = self._last + window - loop.time()
        self._prepared, self._prepare_s, self._due_waiting = False, 0.0, False
        if wait > 0:
            loop.call_later(wait, self._commit_due)
        else:
            loop.call_soon(self._commit_due)

    def _commit_due(self) -> None:
        """The group's window ended: commit it. When it has ``before_commit`` calls, they run
        first and the commit one loop turn later, so what they woke (a submit's audit record,
        written once its row is) still joins this group; at most one such turn per group."""
        if self._tx is None or self._awaiting is not None:
            return
        if self.store.commit_in_flight():  # it would wait for the connection: wait on the loop instead
            self._due_waiting = True
            return
        if self._before_commit and not self._prepared:
            self._prepared = True
            self._prepare()
            return
        self.commit()

    def _prepare(self) -> None:
        """Run the group's ``before_commit`` calls, then commit a loop turn later. A call whose
        statement went out off the loop (``(future, then)``) is finished by :meth:`_resume` once
        its answer is in, and the rest run after it."""
        started = time.perf_counter()
        try:
            pending = self._run_before_commit(wait=False)
        except Exception as exc:  # noqa: BLE001 - the group fails as a failed commit
            self.commit(failed=exc)
            return
        # Their work is the group's requests' own (written at once, it would have been done
        # within the window): the next window does not wait for it again.
        self._prepare_s += time.perf_counter() - started
        if pending is None:
            self._loop.call_soon(self.commit)
            return
        self._awaiting = pending
        loop = self._loop

        def on_loop(_f: concurrent.futures.Future) -> None:  # in the store's thread
            with contextlib.suppress(RuntimeError):  # the loop closed (shutdown): nobody waits
                loop.call_soon_threadsafe(self._resume, pending)

        pending[0].add_done_callback(on_loop)

    def _resume(self, pending: tuple) -> None:
        if self._awaiting is not pending:
            return  # the group ended meanwhile (committed at once, failed or abandoned)
        self._awaiting = None
        started = time.perf_counter()
        try:
            pending[1](pending[0])
        except Exception as exc:  # noqa: BLE001 - the group fails as a failed commit
            self.commit(failed=exc)
            return
        self._prepare_s += time.perf_counter() - started
        self._prepare()

    def _run_before_commit(self, *, wait: bool = True) -> tuple | None:
        """Run what waits to run before the commit (a call awaited by :meth:`_prepare` first).
        A call may return ``(future, then)``: its statement went out off the loop, and
        ``then(future)`` finishes it once it is done. With ``wait`` that is done here (blocking);
        without, the pair is returned at once, the remaining calls kept for later."""
        if self._awaiting is not None:
            awaited, self._awaiting = self._awaiting, None
            _finish(awaited)
        while self._before_commit:  # the group is still open: their writes and commands join it
            calls, self._before_commit = self._before_commit, []
            for i, call in enumerate(calls):
                pending = call()
                if pending is None:
                    continue
                if not wait:
                    self._before_commit = calls[i + 1 :] + self._before_commit
                    return pending
                _finish(pending)
        return None

    def commit(self, *, failed: Exception | None = None) -> None:
        """Commit the open transaction (if any), its ``before_commit`` calls first, then release
        what waited for it; with ``failed`` (a ``before_commit`` call raised), roll it back and
        fail it instead."""
        if self._tx is None:
            return
        started = time.perf_counter()
        try:
            if failed is None:
                self._run_before_commit()
        except Exception as exc:  # noqa: BLE001 - the group fails as a failed commit
            failed = exc
        tx, done, held = self._tx, self._done, self._held
        self._tx, self._done, self._held = None, None, []
        self._cumulative, self._before_commit, self._awaiting = {}, [], None
        try:
            if failed is not None:
                tx.__exit__(type(failed), failed, failed.__traceback__)  # rolls back
            else:
                tx.__exit__(None, None, None)
        except Exception as exc:  # noqa: BLE001 - reported to every waiter
            failed = failed or exc
        if failed is not None:
            log.error(
                "commit failed; in-memory state reloaded from the store",
                error=repr(failed),
                dropped_commands=len(held),
            )
            try:
                self.on_failure()
            except Exception as again:  # noqa: BLE001 - the waiters must still hear of the failure
                log.error("reloading memory after a failed commit failed", error=repr(again))
            done.set_exception(failed)
            done.add_done_callback(lambda f: f.exception())  # no "never retrieved" noise when nobody waits
            return
        self.commits += 1
        self._commit_s = 0.8 * self._commit_s + 0.2 * (time.perf_counter() - started)
        self._last = self._loop.time() - self._prepare_s
        try:
            pending = self.store.flush_pending()
        except Exception as exc:  # noqa: BLE001 - as a failed flush
            pending = concurrent.futures.Future()
            pending.set_exception(exc)
        if pending is None and not self._unflushed:
            self._release(held, done)
            return
        group = [done, held, self._opened]
        self._unflushed.append(group)
        if pending is None:  # durable already, but released after the older groups
            pending = concurrent.futures.Future()
            pending.set_result(None)
        loop = self._loop

        def on_loop(f: concurrent.futures.Future) -> None:  # in the flusher's thread
            with contextlib.suppress(RuntimeError):  # the loop closed (shutdown): nobody waits
                loop.call_soon_threadsafe(self._flushed, group, f)

        pending.add_done_callback(on_loop)

    @staticmethod
    def _release(held: list, done: asyncio.Future) -> None:
        for outbox, command in held:
            outbox.put_nowait(command)
        done.set_result(None)

    def _flushed(self, group: list, flush: concurrent.futures.Future) -> None:
        """On the loop, once ``group``'s flush ended: release it and every older group whose flush
        ended too, in commit order; a failed flush fails its group (and rebuilds memory)."""
        group.append(flush)
        while self._unflushed and len(self._unflushed[0]) == 4:
            done, held, number, result = self._unflushed.pop(0)
            exc = result.exception()
            if exc is None:
                self._release(held, done)
                continue
            self.store.settle()
            log.error(
                "a group commit failed after the loop went on; in-memory state reloaded from the store",
                error=repr(exc),
                dropped_commands=len(held),
            )
            if self._tx is not None and self._opened == number + 1:  # opened since: built on it
                self.abandon(exc)
            try:
                self.on_failure()
            except Exception as again:  # noqa: BLE001 - the waiters must still hear of the failure
                log.error("reloading memory after a failed flush failed", error=repr(again))
            done.set_exception(exc)
            done.add_done_callback(lambda f: f.exception())
        if self._due_waiting and not self.store.commit_in_flight():
            self._due_waiting = False
            self._commit_due()

    def abandon(self, error: Exception) -> None:
        """Roll the open transaction back (this scheduler stopped leading): its held commands
        are dropped and its waiters get ``error``."""
        tx, done, held = self._tx, self._done, self._held
        if tx is None:
            return
        self._tx, self._done, self._held = None, None, []
        self._cumulative, self._before_commit, self._awaiting = {}, [], None
        try:
            tx.__exit__(type(error), error, None)
        except Exception as exc:  # noqa: BLE001 - the rollback of a connection that is gone
            log.warning("rollback of the abandoned group commit failed", error=repr(exc))
        log.warning("group commit abandoned", reason=str(error), dropped_commands=len(held))
        done.set_exception(error)
        done.add_done_callback(lambda f: f.exception())

    def hold(self, outbox: asyncio.Queue, command: object, *, cumulative: bool = False) -> bool:
        """Keep a node command until the open transaction commits (and is durable), or until the
        newest committed group's flush is done; False when neither is pending.

        ``cumulative``: the command says everything an earlier cumulative command of the same
        outbox said (a cumulative acknowledgement): within the open group it takes that one's
        place, so the group sends one of them, the newest, where the first was."""
        if self._tx is not None:
            at = self._cumulative.get(id(outbox)) if cumulative else None
            if at is not None:
                self._held[at] = (outbox, command)
                return True
            if cumulative:
                self._cumulative[id(outbox)] = len(self._held)
            self._held.append((outbox, command))
            return True
        if self._unflushed:
            self._unflushed[-1][1].append((outbox, command))
            return True
        return False

    async def durable(self) -> None:
        """Return once everything written so far is committed (at once when it is).

        Raises:
            sqlite3.Error, StoreUnavailable: the commit failed (those writes are gone; memory was
                rebuilt, or this scheduler stepped down when the store could not be read either).
            NotLeader, Fenced: this scheduler stopped leading; nothing of the group was committed.
        """
        if self._done is not None:
            await asyncio.shield(self._done)
        elif self._unflushed:
            await asyncio.shield(self._unflushed[-1][0])


def _finish(pending: tuple) -> None:
    """Wait for a ``before_commit`` call's ``(future, then)`` (blocking), then ``then(future)``."""
    sent, then = pending
    sent.exception()  # waits for its end
    then(sent)
