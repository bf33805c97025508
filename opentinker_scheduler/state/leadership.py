"""Who leads among several schedulers on one database: a lease row with an epoch.

Every scheduler serves the API; exactly one, the **leader**, places, preempts, enforces
timeouts, runs node streams and writes. The others, **followers**, answer reads from the store
and refuse writes with UNAVAILABLE naming the leader (:class:`~opentinker_scheduler.errors.NotLeader`).

* :class:`StaticLeadership` (SQLite): this scheduler always leads; the state directory's lock
  keeps every other one out. After it stepped down on its own (its memory could not be reloaded
  from a failing store) it leads again as soon as the store is writable.
* :class:`LeaseLeadership` (PostgreSQL): a keeper thread, on its own connection, holds the
  ``leader_lease`` row (epoch, address, expiry) and the leader's lock, a session-level advisory
  lock on that same connection (:class:`~.pg_store.LeaseChannel`). The lease row names the lock's
  session (``lock_pid``). PostgreSQL frees the lock the moment that session ends, so:

  - **The leader's process dies** (kill -9, a crash): its session ends, the lock is free, and the
    next follower to look (every :data:`FOLLOWER_LOOK_S`) takes it and the lease with epoch + 1
    at once, without waiting for the lease to expire. It reads the state as a restarted scheduler
    would (:meth:`~.core.SchedulerCore.promote`) and trainers re-register with it.
  - **The leader's lock session ends while it lives** (the connection terminated or broken): its
    keeper sees the session's socket close and steps down at once; a follower may already lead.
  - **The leader is cut off or stopped** (a partition, SIGSTOP): its session looks alive, so the
    timed lease decides. It expires ``leader_lease`` seconds after the last renewal, by the
    database's clock, and a follower then takes it without the lock; the database ends the old
    session once it has been idle that long (``idle_session_timeout``) and the new leader takes the
    lock at a renewal. The old leader steps down by itself once its own clock says the lease may
    have expired (``valid_until``: last successful renewal + lease - half a renewal interval).

  Fencing stays the epoch's job: whatever a scheduler believes, its transactions end in
  ``ot_fence(<its epoch>)``, which the database refuses for an older epoch
  (:class:`~opentinker_scheduler.errors.Fenced`). Followers name the leader only while its lease
  is valid and its lock session alive, so within a look of a leader's death they name none, then
  the new leader.

All decisions run on the event loop (:meth:`LeaseLeadership._apply`); the keeper thread only
talks to the database and reports what it saw.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import select
import threading
import time
from dataclasses import dataclass

import structlog

from opentinker_scheduler.errors import StoreUnavailable

log = structlog.get_logger("opentinker.scheduler")

#: Seconds between a follower's looks at the leader's lock and lease: at most this after a leader's
#: session ends, a follower leads.
FOLLOWER_LOOK_S = 0.25
#: Seconds between a leader's looks at its lock session's socket while it waits to renew.
LOCK_WATCH_S = 0.05


@dataclass(frozen=True)
class LeaderView:
    """What this scheduler knows of the leadership, for /health and errors."""

    role: str  # "leader" or "follower"
    leader: str  # host:port of the leader ("" unknown)
    epoch: int | None
    #: Several schedulers may share the store (PostgreSQL): /health shows role and leader.
    ha: bool


class StaticLeadership:
    """This scheduler always leads (SQLite, one scheduler per state directory).

    Args:
        core: the :class:`~.core.SchedulerCore` it drives.
        address: this scheduler's ``host:port`` (shown as the leader).
    """

    ha = False

    def __init__(self, core, address: str = "") -> None:
        self.core = core
        self.address = address
        core.on_step_down = self.step_down

    async def start(self) -> None:
        """Nothing to elect: the core leads from its start."""

    async def stop(self) -> None:
        """Nothing to hand over."""

    def step_down(self, reason: str) -> None:
        """The core stepped down on its own; :meth:`check` brings it back."""

    def store_ok(self) -> bool:
        """Whether the store answers now (for /health)."""
        return self.core.store.writable()

    def check(self) -> None:
        """Each tick: lead again once the store can be read (after a failure stepped down)."""
        if self.core.leading or not self.core.store.writable():
            return
        try:
            self.core.promote()
        except Exception as exc:  # noqa: BLE001 - still unreadable: next tick
            log.warning("cannot lead yet: the state store cannot be read", error=repr(exc))

    def view(self) -> LeaderView:
        return LeaderView("leader" if self.core.leading else "follower", self.address, None, False)


class LeaseLeadership:
    """The leader lease in PostgreSQL (see the module docstring).

    Args:
        core: the :class:`~.core.SchedulerCore` (constructed with ``leading=False``).
        store: its :class:`~.pg_store.PostgresStore`.
        address: this scheduler's ``host:port`` as clients and trainers reach it (advertised
            in the lease row; followers name it in NOT_LEADER errors).
        lease_s: seconds a lease lasts without renewal (``store.leader_lease``).
        renew_s: seconds between renewals and between a follower's looks (``store.renew_interval``).
        holder: this instance's id in the lease row (default: address, pid and a random part).
    """

    ha = True

    def __init__(
        self, core, store, *, address: str, lease_s: float = 10.0, renew_s: float = 2.0, holder: str = ""
    ) -> None:
        self.core = core
        self.store = store
        self.address = address
        self.lease_s = lease_s
        self.renew_s = renew_s
        self.holder = holder or f"{address}/{os.getpid()}/{secrets.token_hex(3)}"
        #: Monotonic time until which this scheduler may act as leader (0: it is not one).
        self.valid_until = 0.0
        self.epoch: int | None = None  # the epoch the keeper holds
        self.leader = ""  # the leader's address as last seen
        self.leader_epoch: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._first_look = threading.Event()
        #: Bumped by the loop each time it asks the keeper to hand the lease back; a lease the
        #: keeper reports as taken under an older request is not used (it is about to go back).
        self._give_back_gen = 0
        self._handled_gen = 0
        self._thread: threading.Thread | None = None
        self._channel = None
        #: Whether the keeper's last call reached the database (its thread sets it; /health reads it,
        #: so a database that stops answering never blocks the event loop for a health check).
        self._db_ok = True
        self._locked = False  # the keeper holds the lease with the lock (keeper thread's)
        self.renewals = 0  # successful renewals (profiling)
        self.renew_seconds = 0.0  # time they took, in total
        core.on_step_down = self.step_down
        store.on_fenced = self._fenced
        store.follow("")

    # ------------------------------------------------------------------ loop side
    async def start(self) -> None:
        """Start the keeper; returns after its first look at the lease (so a scheduler alone on
        its database leads as soon as it has started), or after a renewal interval without one."""
        self._loop = asyncio.get_running_loop()
        self._channel = self.store.lease_channel()
        self._channel.call_timeout_s = max(1.0, min(self.renew_s * 2, self.lease_s / 3))
        self._thread = threading.Thread(target=self._keep, name="leader-lease", daemon=True)
        self._thread.start()
        await asyncio.to_thread(self._first_look.wait, self._channel.call_timeout_s + self.renew_s)

    async def stop(self) -> None:
        """Stop the keeper; a leader hands its lease back so a follower takes over at once."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
        if self.epoch is not None and self._channel is not None:
            try:
                await asyncio.to_thread(self._channel.release_lease, self.holder, self.epoch)
                await asyncio.to_thread(self._channel.drop_lock)
                log.info("leader lease handed back", epoch=self.epoch)
            except StoreUnavailable as exc:
                log.warning("could not hand the leader lease back; it expires by itself", error=str(exc))
        if self.core.leading:
            self.core.demote("scheduler stopping")
        if self._channel is not None:
            self._channel.close()

    def store_ok(self) -> bool:
        """Whether the database answered the keeper's last call (no round trip here)."""
        return self._db_ok

    def view(self) -> LeaderView:
        if self.core.leading:
            return LeaderView("leader", self.address, self.store.epoch, True)
        return LeaderView("follower", self.leader, self.leader_epoch, True)

    def check(self) -> None:
        """Each tick: a leader whose lease may have expired by its own clock steps down now
        (after a SIGSTOP, say, before the keeper thread has looked)."""
        if self.core.leading and time.monotonic() > self.valid_until:
            self._lose("the lease was not renewed in time (this scheduler may have been stopped or cut off)")

    def step_down(self, reason: str) -> None:
        """The core stepped down on its own: hand the lease back, take it anew later."""
        self.store.follow(self.leader if self.leader != self.address else "")
        self._give_back_gen += 1
        self._wake.set()

    def _fenced(self) -> None:
        """The database refused a write for a newer epoch (called in the failing commit)."""
        self._lose("the database refused a write: a newer leader epoch holds the lease")

    def _lose(self, reason: str) -> None:
        self.valid_until = 0.0
        self.core.demote(reason)
        self.store.follow("")
        self._give_back_gen += 1
        self._wake.set()

    def _apply(self, event: str, epoch: int | None, address: str, valid_until: float, gen: int) -> None:
        """On the loop: what the keeper saw (``gen``: the hand-back requests it had handled)."""
        if event == "gained":
            if gen != self._give_back_gen:
                return  # taken before the latest hand-back request reached the keeper: going back
            if self.core.leading and self.store.epoch == epoch:
                return
            self.valid_until = valid_until
            self.leader, self.leader_epoch = self.address, epoch
            self.store.lead(epoch)
            try:
                self.core.promote()
            except Exception as exc:  # noqa: BLE001 - the store cannot be read: hand the lease back
                log.error("took the leader lease but cannot read the state store", error=repr(exc))
                self.core.demote("cannot read the state store")
                self.store.follow("")
                self._give_back_gen += 1
                self._wake.set()
                return
            log.info("leader lease taken", epoch=epoch, address=self.address, lease_s=self.lease_s)
        elif event == "renewed":
            if gen == self._give_back_gen and self.core.leading and self.store.epoch == epoch:
                self.valid_until = max(self.valid_until, valid_until)
        elif event == "lost":
            if self.core.leading:
                self._lose(address or "the lease was taken over")
        elif event == "leader":
            changed = (address, epoch) != (self.leader, self.leader_epoch)
            self.leader, self.leader_epoch = address, epoch
            if not self.core.leading:
                self.store.follow(address)
            if changed:
                log.info("following", leader=address or None, epoch=epoch)

    def _report(self, event: str, epoch: int | None = None, address: str = "", valid_until: float = 0.0) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._apply, event, epoch, address, valid_until, self._handled_gen)
        except RuntimeError:  # the loop closed meanwhile
            pass

    # ------------------------------------------------------------------ keeper thread
    def _keep(self) -> None:
        channel = self._channel
        margin = min(self.renew_s / 2, self.lease_s / 4)
        holding = False
        last_error = ""
        while not self._stop.is_set():
            wanted = self._give_back_gen
            if wanted != self._handled_gen:
                self._handled_gen = wanted
                if holding and self.epoch is not None:
                    try:
                        channel.release_lease(self.holder, self.epoch)
                    except StoreUnavailable:
                        pass
                channel.drop_lock()
                holding, self.epoch = False, None
            started = time.monotonic()
            try:
                if holding and self._lock_lost(channel):
                    holding, self.epoch = False, None
                    self._report("lost", address="the database ended this scheduler's lock session")
                elif holding:
                    lock_pid = channel.take_lock(self.lease_s)  # a leader without the lock takes it when free
                    self._locked = bool(lock_pid)
                    if channel.renew_lease(self.holder, self.epoch, self.lease_s, lock_pid):
                        self.renewals += 1
                        self.renew_seconds += time.monotonic() - started
                        self._report("renewed", self.epoch, valid_until=started + self.lease_s - margin)
                    else:
                        holding, self.epoch = False, None
                        self._report("lost", address="the lease was taken over by another scheduler")
                        continue
                else:
                    # The lock only when no live leader holds the lease: a leader without it (after
                    # a partition, or an election another candidate won) takes it at its next look.
                    seen = channel.read_lease()
                    lock_pid = 0 if seen.valid else channel.take_lock(self.lease_s)
                    lease = channel.acquire_lease(self.holder, self.address, self.lease_s, lock_pid)
                    if lease is not None:
                        holding, self.epoch, self._locked = True, lease.epoch, bool(lock_pid)
                        self._report("gained", lease.epoch, valid_until=started + self.lease_s - margin)
                    else:
                        channel.drop_lock()
                        self._report("leader", seen.epoch, seen.address if seen.valid else "")
                last_error = ""
                self._db_ok = True
            except StoreUnavailable as exc:
                self._db_ok = False
                if str(exc) != last_error:
                    log.warning("leader lease: database unreachable", error=str(exc), holding=holding)
                    last_error = str(exc)
                if holding and self._lock_lost(channel):  # step down now: a follower may lead already
                    holding, self.epoch = False, None
                    self._report("lost", address="the database ended this scheduler's lock session")
                # Holding with the lock still: keep trying to renew; the loop's check() steps
                # down by valid_until.
            except Exception as exc:  # noqa: BLE001 - never let the keeper die
                log.exception("leader lease keeper error", error=repr(exc))
            self._first_look.set()  # after its report: the loop applies that first
            # A leader without the lock looks again soon: a kill -9 frees only a lock that is held.
            locked = holding and self._locked
            self._wait(channel, self.renew_s if locked else min(self.renew_s, FOLLOWER_LOOK_S))

    def _lock_lost(self, channel) -> bool:
        """Holding the lease with the lock, the lock's session has ended."""
        if self._locked and not channel.lock_held():
            self._locked = False
            return True
        if channel.lock_held():
            self._locked = True
        return False

    def _wait(self, channel, timeout: float) -> None:
        """Wait ``timeout`` seconds, until woken, or until the database writes on the lock's idle
        session (it does so when it ends it): then the next look comes at once."""
        deadline = time.monotonic() + timeout
        while not self._wake.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            fd = channel.lock_socket()
            if fd < 0:
                self._wake.wait(left)
                break
            try:
                readable, _, _ = select.select([fd], [], [], min(left, LOCK_WATCH_S))
            except (OSError, ValueError):  # the socket closed meanwhile
                break
            if readable:
                break
        self._wake.clear()
