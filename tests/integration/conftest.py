"""Fixtures of the integration tests.

``dsn`` is overridden here: instead of a ``CREATE DATABASE`` per test (a few hundred
milliseconds each), the integration tests share one database per session that is emptied
before every test (every non-system schema dropped, leftover sessions ended), which is just
as fresh for what these tests look at. Tests that need several databases use
:func:`outbox_celery.testing.temporary_database` themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_celery import Store
from outbox_celery.testing import temporary_database

from .helpers import Connect


@pytest.fixture(scope="session")
def integration_db(server_dsn: str) -> Iterator[str]:
    """One database for the whole integration session."""
    with temporary_database(server_dsn, prefix="outbox_it") as db:
        yield db


@pytest.fixture
def dsn(integration_db: str) -> str:
    """The integration database, emptied: no user schema, no other session connected."""
    with psycopg.connect(integration_db, autocommit=True) as c:
        c.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        schemas = c.execute(
            "SELECT nspname FROM pg_namespace"
            " WHERE nspname NOT LIKE 'pg\\_%' AND nspname <> 'information_schema'"
        ).fetchall()
        for (name,) in schemas:
            c.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))
        c.execute("CREATE SCHEMA public")
    return integration_db


@pytest.fixture
def store(table: str) -> Store:
    """A Store bound to the test's outbox table."""
    return Store(table)


@pytest.fixture
def connect(migrated_dsn: str) -> Iterator[Connect]:
    """Open extra autocommit connections (one per simulated worker); closed after the test."""
    opened: list[psycopg.Connection[Any]] = []

    def _connect() -> psycopg.Connection[Any]:
        c = psycopg.connect(migrated_dsn, autocommit=True)
        opened.append(c)
        return c

    yield _connect
    for c in opened:
        c.close()
