from tests.support.fake_scheduler import fake  # noqa: F401  (the fixture: a running TEST DOUBLE of the scheduler)
