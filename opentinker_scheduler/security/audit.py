"""The audit log: who did what to which task or key, when, and how it ended.

Each record is written twice:

* a structured log line from the ``opentinker.audit`` logger (``event="audit"``, JSON when the
  scheduler's stderr is not a terminal), for log shippers;
* a row of the ``audit_log`` table in the scheduler's state store, committed with the action
  it describes, readable with ``AdminService.ListAuditEvents``.

Audited actions: ``task.submit``, ``adapter.import`` (``ImportAdapter``: a task made from an
adapter folder), ``task.cancel``, ``task.delete_artifacts``, ``key.create``, ``key.revoke``,
``key.rotate``, ``node.join``, ``queue.set`` (a quota queue changed at run time), ``queue.reset``
(its runtime override removed). Refused authentication
(``auth.refused``) is logged only, never stored, so a caller spraying bad keys cannot grow the database.
Every refused action is counted per action, owner and status code (:attr:`AuditLog.refusals`,
``opentinker_audit_refusals_total`` on ``/metrics``). It is also logged and stored while its
owner's refusal budget lasts (:data:`REFUSAL_ROWS_BURST` rows, refilled at
:data:`REFUSAL_ROWS_PER_S`), so the first refusals keep their details for an investigation and a
flood of refused calls costs no database row and no log line past the budget. Accepted actions
are always logged and stored.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import structlog

from opentinker_scheduler.state.store import StateStore

log = structlog.get_logger("opentinker.audit")

# The audit_log table: opentinker_scheduler/state/schema.py (migrations of both store backends).

ACTIONS = (
    "task.submit",
    "adapter.import",
    "task.cancel",
    "task.delete_artifacts",
    "checkpoint.delete",
    "checkpoint.set_ttl",
    "key.create",
    "key.revoke",
    "key.rotate",
    "node.join",
    "queue.set",
    "queue.reset",
)


#: Refusal records one owner may have logged and stored at once, before the budget refills.
REFUSAL_ROWS_BURST = 20

#: Refusal records per second an owner's budget refills by: one every 10 s.
REFUSAL_ROWS_PER_S = 0.1


@dataclass(frozen=True)
class AuditRecord:
    id: int
    time: float
    owner: str
    role: str
    key_prefix: str
    action: str
    task_id: str
    outcome: str
    detail: dict[str, Any]


class AuditLog:
    """Writes audit records to the log and to ``audit_log`` in ``store``'s database."""

    def __init__(self, store: StateStore | None) -> None:
        self.store = store
        #: ``(action, owner, status code name)`` -> refusals since the start, stored or not; the
        #: event loop increments, the HTTP port's thread reads.
        self.refusals: dict[tuple[str, str, str], int] = {}
        #: owner -> (refusal records left in the budget, monotonic time of the last refill).
        self._budget: dict[str, tuple[float, float]] = {}

    def record(
        self,
        action: str,
        *,
        owner: str,
        role: str,
        key_prefix: str = "",
        task_id: str = "",
        outcome: str = "OK",
        **detail: Any,
    ) -> None:
        """Log and store one record. A refusal (``outcome`` other than ``OK``) adds one to
        :attr:`refusals` and is logged and stored only while its owner's budget lasts
        (:meth:`_within_budget`). ``detail`` values
        must be JSON-serializable (others are stored as their ``str``). The row joins the
        store's open transaction (a group commit's:
        :meth:`~opentinker_scheduler.state.store.StateStore.add_audit`), so it commits with the
        action's own writes. A failing database write is logged, never raised: the action itself
        already happened (or was refused) and the log line stands."""
        if outcome != "OK":
            counted = (action, owner, outcome)
            self.refusals[counted] = self.refusals.get(counted, 0) + 1
            if not self._within_budget(owner):
                return
        now = time.time()
        log.info(
            "audit",
            action=action,
            owner=owner,
            role=role,
            key_prefix=key_prefix,
            task_id=task_id,
            outcome=outcome,
            audit_time=now,
            **detail,
        )
        if self.store is None or self.store.read_only:
            return  # a follower writes nothing; the log line stands (the leader audits what it does)
        try:
            with self.store.batch():  # written with the open (group) transaction's other writes
                self.store.add_audit(
                    (now, owner, role, key_prefix, action, task_id, outcome, json.dumps(detail, default=str))
                )
        except Exception as exc:  # noqa: BLE001 - see docstring
            log.error("audit record not stored", action=action, error=repr(exc))

    def _within_budget(self, owner: str) -> bool:
        """Take one record from ``owner``'s refusal budget, a token bucket of
        :data:`REFUSAL_ROWS_BURST` refilled at :data:`REFUSAL_ROWS_PER_S`; False when empty."""
        now = time.monotonic()
        left, then = self._budget.get(owner, (REFUSAL_ROWS_BURST, now))
        left = min(REFUSAL_ROWS_BURST, left + (now - then) * REFUSAL_ROWS_PER_S)
        if left < 1:
            self._budget[owner] = (left, now)
            return False
        self._budget[owner] = (left - 1, now)
        return True

    def refused(self, *, method: str, reason: str, outcome: str, key_prefix: str = "", peer: str = "") -> None:
        """Log (only) a refused call: no key, bad key, wrong role, missing client certificate."""
        log.warning(
            "audit",
            action="auth.refused",
            method=method,
            outcome=outcome,
            reason=reason,
            key_prefix=key_prefix,
            peer=peer,
        )

    def list(self, *, limit: int = 100, before_id: int = 0, action: str = "") -> list[AuditRecord]:
        """Records newest first, those of the open (group) transaction included."""
        if self.store is None:
            return []
        self.store.flush_audit()
        sql = "SELECT id, time, owner, role, key_prefix, action, task_id, outcome, detail FROM audit_log"
        where, args = [], []
        if before_id:
            where.append("id < ?")
            args.append(before_id)
        if action:
            where.append("action = ?")
            args.append(action)
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id DESC LIMIT ?"
        args.append(limit)
        return [
            AuditRecord(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], json.loads(r[8] or "{}"))
            for r in self.store.db.execute(sql, args)
        ]
