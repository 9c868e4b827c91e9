"""Batched ``done`` writes: one fenced statement for many rows (DESIGN invariant 4).

The worker-process side (kills and shutdowns inside the window) is in
``tests/acceptance/test_celery_done_batch.py``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import ConnectionPool
from support import steps

from outbox_celery import OutboxConfig, Store, TableName
from outbox_celery.errors import Defer, PermanentError, RetryableError
from outbox_celery.handlers import HandlerSpec
from outbox_celery.message import Outcome
from outbox_celery.testing import InProcess

from .helpers import LONG, add, fetch


def _claim_all(conn: psycopg.Connection[Any], store: Store, n: int) -> dict[int, int]:
    claimed = steps.claim(store, conn, limit=n, lease=LONG, owner="w", max_attempts=5).claimed
    for c in claimed:
        assert steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5) is not None
    return {c.id: c.lease_version for c in claimed}


def test_invariant_4_done_many_fences_each_row_on_its_own_version(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    ids = add(conn, 4, table=table)
    versions = _claim_all(conn, store, 4)
    stale = ids[0]
    # Another claim took the first row since (its version moved on): the old version's done
    # must leave it alone, and only it.
    conn.execute(
        sql.SQL("UPDATE {} SET lease_version = lease_version + 1 WHERE id = %s").format(
            TableName.parse(table).identifier()
        ),
        [stale],
    )
    won = steps.done_many(store, conn, [(i, versions[i]) for i in ids]).applied
    assert won == set(ids[1:])
    assert fetch(conn, table, stale)["status"] == "processing"
    assert {fetch(conn, table, i)["status"] for i in ids[1:]} == {"done"}
    assert all(fetch(conn, table, i)["done_at"] is not None for i in ids[1:])
    stats = store.get_stats()
    assert (stats["done"], stats["lost_leases"]) == (3, 1)
    # Written twice (a retry after a lost reply): the second changes nothing.
    assert steps.done_many(store, conn, [(ids[1], versions[ids[1]])]).applied == set()


def test_done_many_never_finishes_an_ordered_row(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    # An ordered row's done moves its key's head under the key lock: only Store.done does that.
    [i] = add(conn, table=table, key="k")
    versions = _claim_all(conn, store, 1)
    assert steps.done_many(store, conn, [(i, versions[i])]).applied == set()
    assert fetch(conn, table, i)["status"] == "processing"


@pytest.fixture
def pool(migrated_dsn: str) -> Any:
    with ConnectionPool(migrated_dsn, min_size=1, max_size=4, kwargs={"autocommit": True}, open=True) as p:
        yield p


def _dispatcher(pool: ConnectionPool[Any], table: str, handler: Any = None, **config: Any) -> InProcess:
    spec = HandlerSpec("thing.happened", handler or (lambda m: None), "q")
    return InProcess(OutboxConfig(table=table, **config), pool.connection, {"thing.happened": spec})


def _wait_status(conn: psycopg.Connection[Any], table: str, i: int, status: str, timeout: float) -> float:
    started = time.monotonic()
    while fetch(conn, table, i)["status"] != status:
        assert time.monotonic() - started < timeout, f"row {i} not {status} within {timeout}s"
        time.sleep(0.01)
    return time.monotonic() - started


def test_a_batched_done_is_written_within_its_delay(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    dispatcher = _dispatcher(pool, table, lease=LONG, done_batch_delay=0.5)
    ids = add(conn, 3, table=table)
    claimed = steps.claim(dispatcher.store, conn, limit=3, lease=LONG, owner="w", max_attempts=5).claimed
    versions = {c.id: c.lease_version for c in claimed}
    for i in ids:
        assert dispatcher.deliver(i, versions[i], batch_done=True) == Outcome.DONE
    # Handled, reported done, still held by this process.
    assert [fetch(conn, table, i)["status"] for i in ids] == ["processing"] * 3
    assert dispatcher.done_batch is not None and dispatcher.done_batch.pending() == 3
    _wait_status(conn, table, ids[-1], "done", timeout=5.0)
    assert {fetch(conn, table, i)["status"] for i in ids} == {"done"}
    assert dispatcher.store.get_stats()["done"] == 3


def _held(conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]) -> tuple[InProcess, int]:
    """One message delivered whose done this process holds (a window longer than the test)."""
    dispatcher = _dispatcher(pool, table, lease=LONG, done_batch_delay=LONG / 5)
    [i] = add(conn, table=table)
    [c] = steps.claim(dispatcher.store, conn, limit=1, lease=LONG, owner="w", max_attempts=5).claimed
    assert dispatcher.deliver(i, c.lease_version, batch_done=True) == Outcome.DONE
    assert fetch(conn, table, i)["status"] == "processing"
    return dispatcher, i


def test_flush_writes_what_is_held_at_once(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    dispatcher, i = _held(conn, table, pool)
    dispatcher.flush()  # what Outbox.close() does at worker shutdown
    assert fetch(conn, table, i)["status"] == "done"


def test_a_done_with_little_lease_left_is_written_at_once(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    # Lease 2 s, a handler of 1.2 s: holding the done for the batch could let the lease end
    # first, so it is written as the handler returns.
    dispatcher = _dispatcher(
        pool, table, handler=lambda m: time.sleep(1.2), lease=2.0, claim_interval=1.0, done_batch_delay=0.3
    )
    [i] = add(conn, table=table)
    [c] = steps.claim(dispatcher.store, conn, limit=1, lease=2.0, owner="w", max_attempts=5).claimed
    assert dispatcher.deliver(i, c.lease_version, batch_done=True) == Outcome.DONE
    assert fetch(conn, table, i)["status"] == "done"


def test_without_batch_done_or_with_a_zero_delay_done_is_written_at_once(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    for dispatcher, batch in (
        (_dispatcher(pool, table, lease=LONG), False),
        (_dispatcher(pool, table, lease=LONG, done_batch_delay=0), True),
    ):
        [i] = add(conn, table=table)
        [c] = steps.claim(dispatcher.store, conn, limit=1, lease=LONG, owner="w", max_attempts=5).claimed
        assert dispatcher.deliver(i, c.lease_version, batch_done=batch) == Outcome.DONE
        assert fetch(conn, table, i)["status"] == "done"


def test_a_forked_child_never_writes_the_parents_held_dones(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    dispatcher, i = _held(conn, table, pool)
    batch = dispatcher.done_batch
    assert batch is not None
    pid = os.fork()
    if pid == 0:  # the child: what it inherited is the parent's to write
        os._exit(0 if batch.pending() == 0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert batch.pending() == 1
    dispatcher.flush()
    assert fetch(conn, table, i)["status"] == "done"


@pytest.mark.parametrize(
    ("error", "outcome", "status"),
    [
        (RetryableError("HTTP 503", delay=60), Outcome.RETRY, "pending"),
        (PermanentError("HTTP 400"), Outcome.DEAD, "dead"),
        (Defer(60, reason="not yet"), Outcome.DEFER, "pending"),
    ],
)
def test_only_a_done_is_ever_held_other_outcomes_are_written_at_once(
    conn: psycopg.Connection[Any],
    table: str,
    pool: ConnectionPool[Any],
    error: Exception,
    outcome: Outcome,
    status: str,
) -> None:
    def handler(message: Any) -> None:
        raise error

    dispatcher = _dispatcher(pool, table, handler=handler, lease=LONG, done_batch_delay=LONG / 5)
    [i] = add(conn, table=table)
    [c] = steps.claim(dispatcher.store, conn, limit=1, lease=LONG, owner="w", max_attempts=5).claimed
    assert dispatcher.deliver(i, c.lease_version, batch_done=True) == outcome
    assert fetch(conn, table, i)["status"] == status
    assert dispatcher.done_batch is not None and dispatcher.done_batch.pending() == 0


def test_invariant_4_a_task_redelivered_inside_the_window_calls_no_handler(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    # The Celery message is acknowledged when the task returns, before the
    # batched done is written. Should that ack be lost (a broker connection dropped), the broker
    # hands the task to another worker while this process still holds the done. Its fenced
    # start would pass on the lease_version and the attempts left alone, and run the handler
    # again; a claim starts once, so the copy calls nothing and the held done still lands.
    dispatcher, i = _held(conn, table, pool)
    version = fetch(conn, table, i)["lease_version"]
    runs: list[int] = []
    other = _dispatcher(pool, table, lambda m: runs.append(m.id), lease=LONG, done_batch_delay=0.05)
    assert other.deliver(i, version, batch_done=True) == Outcome.STALE
    assert runs == []
    dispatcher.flush()
    row = fetch(conn, table, i)
    assert (row["status"], row["attempts"]) == ("done", 1)
