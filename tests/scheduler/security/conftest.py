"""The key store and the audit log keep their tables in the state store: their unit tests that
ask for ``store_backend`` run on both backends, SQLite and PostgreSQL (tests/support/stores.py)."""

import pytest

from tests.support.stores import backend_fixture, pytest_generate_tests  # noqa: F401

store_backend = pytest.fixture(backend_fixture)
