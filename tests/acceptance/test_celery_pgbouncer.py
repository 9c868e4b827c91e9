"""Through a real PgBouncer in transaction pooling mode.

PgBouncer hands each transaction whatever server connection is free (here rotated round robin,
as many concurrent clients would make it), so nothing may live in a PostgreSQL session: the
claim lock is transaction-scoped, and psycopg's automatic prepared statements are disabled with
``prepare_threshold=None`` (this PgBouncer is older than 1.21). Checked at three levels: the
store's claim, start and finalize; repeated claim runs; and real beat and worker processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool
from support import steps
from support.db import calls, statuses
from support.pgbouncer import pgbouncer

from acceptance.conftest import HarnessFactory
from outbox_celery import Event, OutboxConfig, Store, enqueue_many
from outbox_celery.handlers import HandlerSpec
from outbox_celery.testing import InProcess

pytestmark = pytest.mark.slow

EVENT = "thing.happened"


@pytest.fixture
def through(server_dsn: str) -> Iterator[Callable[[str], str]]:
    with pgbouncer(server_dsn) as rewrite:
        yield rewrite


def _spread_server_connections(dsn: str, n: int = 4) -> None:
    """Make PgBouncer open ``n`` server connections (concurrent transactions need them)."""
    barrier = threading.Barrier(n)

    def hold() -> None:
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as c, c.transaction():
            barrier.wait(timeout=10)
            c.execute("SELECT pg_sleep(0.2)")

    threads = [threading.Thread(target=hold) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _enqueue(dsn: str, n: int) -> list[int]:
    with psycopg.connect(dsn) as conn, conn.transaction():
        events = [Event(EVENT, {"i": i}, aggregate_type="thing", aggregate_id=str(i)) for i in range(n)]
        return enqueue_many(conn, events)


def test_store_claim_start_and_finalize_through_pgbouncer(
    migrated_dsn: str, through: Callable[[str], str]
) -> None:
    bounced = through(migrated_dsn)
    _spread_server_connections(bounced)
    ids = _enqueue(bounced, 20)
    store = Store("outbox")
    with psycopg.connect(bounced, autocommit=True, prepare_threshold=None) as conn:
        claimed = steps.claim(store, conn, limit=20, lease=30.0, owner="t", max_attempts=5).claimed
        assert sorted(c.id for c in claimed) == ids
        for c in claimed:
            msg = steps.start(store, conn, c.id, c.lease_version, lease=30.0, max_attempts=5)
            assert msg is not None and msg.attempts == 1
            assert steps.done(store, conn, c.id, c.lease_version)
        assert store.get_stats().get("lost_leases", 0) == 0
    with psycopg.connect(migrated_dsn) as direct:
        assert statuses(direct, "outbox") == {"done": 20}


def test_invariant_1_claim_runs_through_pgbouncer_never_lock_each_other_out(
    migrated_dsn: str, through: Callable[[str], str]
) -> None:
    """A session lock taken on one server connection and "released" on another left every
    later run skipped as another_claim_running; the transaction lock cannot."""
    bounced = through(migrated_dsn)
    _spread_server_connections(bounced)
    config = OutboxConfig(
        dsn=bounced,
        lease=30.0,
        batch_size=5,
        adaptive_in_flight=False,
        claim_budget=0.001,
        prepare_threshold=None,
    )
    with ConnectionPool(
        bounced,
        min_size=2,
        max_size=4,
        kwargs={"autocommit": True, "prepare_threshold": None},
        open=True,
    ) as pool:

        @contextmanager
        def connection() -> Iterator[psycopg.Connection[Any]]:
            with pool.connection() as conn:
                yield conn

        dispatcher = InProcess(config, connection, {EVENT: HandlerSpec(EVENT, lambda m: None, "q")})
        ids = _enqueue(bounced, 40)
        published: list[int] = []
        runs = []
        for _ in range(12):
            run = dispatcher.claim_and_publish(lambda cs: published.extend(c.id for c in cs) or len(cs))
            runs.append(run.stopped_by)
        assert "another_claim_running" not in runs, runs
        assert sorted(published) == ids  # each row handed out once


def test_beat_and_worker_deliver_through_pgbouncer(
    harness_factory: HarnessFactory, redis_url: str, through: Callable[[str], str]
) -> None:
    h = harness_factory(redis_url)
    h.spec.dsn = through(h.dsn)
    _spread_server_connections(h.spec.dsn)
    h.configure(lease=10.0, prepare_threshold=None)
    ids = h.enqueue(150)
    h.worker(concurrency=2)
    h.beat()
    h.wait_finished(150, timeout=120)
    assert {r["status"] for r in h.rows()} == {"done"}
    assert sorted({c["outbox_id"] for c in calls(h.conn)}) == ids
    # Concurrent claim runs legitimately skip each other here; none may hit a missing
    # prepared statement or a lock left on another server connection (all rows were delivered).
    for p in h.procs.started:
        assert "prepared statement" not in p.log()
