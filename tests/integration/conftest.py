from __future__ import annotations

import pytest

from tests.support.procs import Cluster


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()
