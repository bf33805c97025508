"""Every store test here runs on both backends, SQLite and PostgreSQL (tests/support/stores.py)."""

from tests.support.stores import pytest_generate_tests, store_backend_fixture  # noqa: F401

store_backend = store_backend_fixture()
