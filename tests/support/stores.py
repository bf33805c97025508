"""Store tests on both backends: SQLite in the test's folder, and PostgreSQL (a real server on
loopback, :mod:`tests.support.postgres`), one fresh schema per folder.

A test folder's conftest makes every test that uses ``store_backend`` (autouse there) run once
per backend, ids ``[sqlite]`` and ``[postgres]`` (``pytest_generate_tests`` below); a test marked
``sqlite_only`` (it opens the SQLite file itself) runs on SQLite only, one marked
``postgres_only`` (several schedulers on one database, a database restart) on PostgreSQL only. Inside a test,
:func:`make_store` opens the current backend's store for a folder, the same one again for the same
folder (a restart), already leading (the PostgreSQL lease taken with a fixed holder, so a reopened
store takes it back at once, as a restarted leader does).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from opentinker_scheduler.config import SchedulerConfig
from opentinker_scheduler.config.store import StoreConfig
from opentinker_scheduler.state.store import SqliteStore, StateStore

BACKENDS = ("sqlite", "postgres")

#: Holder id and address of the lease the test stores take.
TEST_HOLDER = "tests"


class _Current:
    name = "sqlite"
    server = None  # PostgresServer
    schemas: dict[str, str] = {}
    opened: list[StateStore] = []


current = _Current()


def pytest_generate_tests(metafunc) -> None:
    if "store_backend" in metafunc.fixturenames:
        marked = metafunc.definition.get_closest_marker
        names = ["sqlite"] if marked("sqlite_only") else ["postgres"] if marked("postgres_only") else list(BACKENDS)
        metafunc.parametrize("store_backend", names, indirect=True)


def backend_fixture(request):
    """Body of the ``store_backend`` fixture: select the backend, close what the test opened."""
    name = getattr(request, "param", "sqlite")
    current.name = name
    current.server = request.getfixturevalue("postgres_server") if name == "postgres" else None
    current.schemas = {}
    current.opened = []
    try:
        yield name
    finally:
        for store in current.opened:
            try:
                store.close()
            except Exception:  # noqa: BLE001 - closed already, or its server went away
                pass
        current.name, current.server = "sqlite", None


def _schema_for(folder: Path) -> str:
    key = str(folder)
    if key not in current.schemas:
        current.schemas[key] = current.server.new_schema()
    return current.schemas[key]


def store_config(folder: Path) -> StoreConfig:
    """The ``store:`` section for ``folder`` on the current backend."""
    if current.name == "sqlite":
        return StoreConfig()
    return StoreConfig(kind="postgres", dsn=current.server.dsn(), schema=_schema_for(folder))


def with_store(config: SchedulerConfig) -> SchedulerConfig:
    """``config`` with the current backend's ``store:`` for its state_dir."""
    return dataclasses.replace(config, store=store_config(config.state_dir))


def make_store(folder: Path, *, lead: bool = True) -> StateStore:
    """The current backend's store for ``folder`` (the same data for the same folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    if current.name == "sqlite":
        store: StateStore = SqliteStore(folder)
    else:
        from opentinker_scheduler.state.pg_store import PostgresStore

        store = PostgresStore(current.server.dsn(), schema_name=_schema_for(folder))
        if lead:
            take_lead(store)
    current.opened.append(store)
    return store


def take_lead(store: StateStore, holder: str = TEST_HOLDER) -> int:
    """Take the lease (for an hour) and lead with its epoch; returns the epoch."""
    lease = store.acquire_lease(holder, f"{holder}:0", 3600)
    assert lease is not None, "the lease is held by another holder"
    store.lead(lease.epoch)
    return lease.epoch


def committed(store: StateStore, sql: str, params=()) -> list[tuple]:
    """Rows of ``sql`` (``?`` placeholders) read on a second connection: only what is committed."""
    if store.kind == "sqlite":
        import sqlite3

        with sqlite3.connect(store.path) as other:
            return [tuple(r) for r in other.execute(sql, params)]
    import psycopg

    from opentinker_scheduler.state.schema import postgres_query

    with psycopg.connect(store._conninfo, autocommit=True) as other:
        return [tuple(r) for r in other.execute(postgres_query(sql) if params else sql, params or None)]


def store_backend_fixture():
    """A ``store_backend`` fixture (autouse) for a conftest: ``store_backend = store_backend_fixture()``."""
    return pytest.fixture(autouse=True)(backend_fixture)
