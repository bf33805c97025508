"""Opening the state store the config names: SQLite (:mod:`.store`) or PostgreSQL (:mod:`.pg_store`).

Kept apart from both backends so neither imports the other: ``pg_store`` builds on ``store``'s
interface, and only this module knows them both.
"""

from __future__ import annotations

from opentinker_scheduler.state.pg_store import PostgresStore
from opentinker_scheduler.state.store import SqliteStore, StateStore


def open_store(config) -> StateStore:
    """The store a :class:`~opentinker_scheduler.config.SchedulerConfig` names (``store:``):
    SQLite under ``state_dir`` (the default), or PostgreSQL (its password read now).

    Raises:
        OSError: as :class:`SqliteStore` / :class:`~.pg_store.PostgresStore` (a state directory in use,
            a database that cannot be reached, a password variable that is unset, ...).
        SchemaTooNew: the store was migrated by a newer scheduler.
    """
    sc = config.store
    if sc.kind == "postgres":
        return PostgresStore(
            sc.dsn,
            password=sc.password(),
            schema_name=sc.schema,
            call_timeout_s=sc.call_timeout_s,
            idle_in_transaction_s=max(1.0, min(5.0, sc.leader_lease_s / 2)),
            synchronous_commit=sc.synchronous_commit,
        )
    return SqliteStore(config.state_dir)
