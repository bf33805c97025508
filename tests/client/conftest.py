import pytest

from tests.client.fake_scheduler import FakeScheduler, Server


@pytest.fixture
def fake():
    """A running TEST DOUBLE of the scheduler: yields (servicer, server)."""
    servicer = FakeScheduler()
    server = Server(servicer)
    try:
        yield servicer, server
    finally:
        server.stop()
