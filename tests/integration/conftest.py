"""Fixtures of the integration tests (a migrated fresh database per test comes from ../conftest)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outbox_celery import Store

from .helpers import Connect


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
