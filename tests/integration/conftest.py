from __future__ import annotations

import pytest

from tests.support.fake_scheduler import fake  # noqa: F401  (the fixture: a running TEST DOUBLE of the scheduler)
from tests.support.procs import Cluster


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()
