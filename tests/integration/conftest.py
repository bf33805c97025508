from __future__ import annotations

import pytest

from tests.support.fake_scheduler import fake  # noqa: F401  (the fixture: a running TEST DOUBLE of the scheduler)
from tests.support.procs import Cluster


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


@pytest.fixture(params=["sqlite", "postgres"])
def backend_cluster(request, tmp_path):
    """A :class:`Cluster` whose one scheduler keeps its state in SQLite, or in a real PostgreSQL
    (its own schema; leader lease 3 s), for the kill -9 tests on both backends."""
    text = "heartbeat_interval: 0.5\nlease: 3\n"
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        text += (
            f'store:\n  kind: postgres\n  dsn: "{server.dsn()}"\n  schema: {server.new_schema("c")}\n'
            "  leader_lease: 3\n  renew_interval: 0.5\n"
        )
    c = Cluster(tmp_path, text)
    yield c
    c.close()
