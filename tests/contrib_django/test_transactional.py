"""``transactional="django"`` (DESIGN invariant 20): the ORM's writes, the follow-up event and
the fenced done commit in one ``transaction.atomic()`` on Django's connection.

Real workers running Django transactional handlers (SIGKILL, a stale worker, a retry) are in
``tests/acceptance/test_celery_transactional.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection, connections
from psycopg_pool import ConnectionPool
from support import steps

from outbox_celery import Message, OutboxConfig, RetryableError, Store, enqueue
from outbox_celery.handlers import HandlerSpec
from outbox_celery.message import Outcome
from outbox_celery.testing import InProcess
from outbox_celery.transactional import DjangoTransaction

from .testapp.models import Order

EVENT = "order.pay"


@pytest.fixture
def pool(django_db: str) -> Iterator[ConnectionPool[Any]]:
    with ConnectionPool(django_db, min_size=1, max_size=4, kwargs={"autocommit": True}, open=True) as p:
        yield p


def _committed(dsn: str, query: str) -> list[tuple[Any, ...]]:
    """What another session sees."""
    with psycopg.connect(dsn) as c:
        return c.execute(query).fetchall()


def test_invariant_20_django_orm_writes_follow_up_and_done_commit_together(
    django_db: str, pool: ConnectionPool[Any]
) -> None:
    seen: list[bool] = []

    def handler(message: Message, conn: Any) -> None:
        assert conn is connections["default"]
        seen.append(connection.in_atomic_block)
        Order.objects.create(total=message.attempts)
        enqueue(
            conn.connection,
            event_type="order.paid",
            payload={"after": message.id},
            aggregate_type="order",
            aggregate_id=str(message.id),
        )
        if message.attempts == 1:
            raise RetryableError("once", delay=0)

    spec = HandlerSpec(EVENT, handler, "q", transaction=DjangoTransaction())
    dispatcher = InProcess(OutboxConfig(lease=60.0), pool.connection, {EVENT: spec})
    store = Store()
    with psycopg.connect(django_db, autocommit=True) as c:
        with c.transaction():
            i = enqueue(c, event_type=EVENT, payload={}, aggregate_type="order", aggregate_id="1")
        for expected in (Outcome.RETRY, Outcome.DONE):
            [claim] = steps.claim(
                store, c, limit=1, lease=60.0, owner="w", max_attempts=5, event_types=[EVENT]
            ).claimed
            assert dispatcher.deliver(i, claim.lease_version) == expected
            if expected is Outcome.RETRY:
                # Attempt 1's order and follow-up were rolled back with it.
                assert _committed(django_db, "SELECT total FROM testapp_order") == []
                assert _committed(django_db, "SELECT id FROM outbox WHERE event_type = 'order.paid'") == []
    assert seen == [True, True]
    assert _committed(django_db, "SELECT total FROM testapp_order") == [(2,)]
    assert _committed(django_db, f"SELECT status FROM outbox WHERE id = {int(i)}") == [("done",)]
    assert len(_committed(django_db, "SELECT id FROM outbox WHERE event_type = 'order.paid'")) == 1


def _claim(dsn: str, outbox_id: int) -> int:
    with psycopg.connect(dsn, autocommit=True) as c:
        claimed = steps.claim(Store(), c, limit=1, lease=60.0, owner="w", max_attempts=5, event_types=[EVENT])
        [claim] = claimed.claimed
        assert claim.id == outbox_id
        return claim.lease_version


def _enqueue(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as c, c.transaction():
        return enqueue(c, event_type=EVENT, payload={}, aggregate_type="order", aggregate_id="1")


def test_invariant_20_a_django_handler_s_session_state_never_reaches_the_next_user_of_the_connection(
    django_db: str, pool: ConnectionPool[Any]
) -> None:
    def handler(message: Message, conn: Any) -> None:
        Order.objects.create(total=1)
        with conn.cursor() as cur:
            cur.execute("SET app.tenant = '42'")
            cur.execute("SET synchronous_commit = off")

    spec = HandlerSpec(EVENT, handler, "q", transaction=DjangoTransaction())
    dispatcher = InProcess(OutboxConfig(lease=60.0), pool.connection, {EVENT: spec})
    i = _enqueue(django_db)
    assert dispatcher.deliver(i, _claim(django_db, i)) == Outcome.DONE
    # The thread's Django connection, as the application's next query in this worker uses it.
    with connection.cursor() as cur:
        cur.execute("SELECT current_setting('app.tenant', true), current_setting('synchronous_commit')")
        assert cur.fetchone() == (None, "on")
    assert _committed(django_db, "SELECT total FROM testapp_order") == [(1,)]


def test_invariant_20_a_django_handler_that_sets_rollback_is_a_retryable_failure_not_done(
    django_db: str, pool: ConnectionPool[Any]
) -> None:
    from django.db import transaction

    def handler(message: Message, conn: Any) -> None:
        Order.objects.create(total=message.attempts)
        if message.attempts == 1:
            transaction.set_rollback(True)

    spec = HandlerSpec(EVENT, handler, "q", transaction=DjangoTransaction())
    dispatcher = InProcess(OutboxConfig(lease=60.0, max_attempts=2), pool.connection, {EVENT: spec})
    i = _enqueue(django_db)
    assert dispatcher.deliver(i, _claim(django_db, i)) == Outcome.RETRY
    [(status, attempts, lease_until, error)] = _committed(
        django_db, f"SELECT status, attempts, lease_until, last_error FROM outbox WHERE id = {int(i)}"
    )
    # Nothing committed, and it says so: back after a backoff, no lease left to run out.
    assert (status, attempts, lease_until) == ("pending", 1, None)
    assert "transaction.set_rollback(True)" in error and "nothing it wrote was committed" in error
    assert _committed(django_db, "SELECT total FROM testapp_order") == []
    with psycopg.connect(django_db, autocommit=True) as c:
        c.execute("UPDATE outbox SET available_at = now() WHERE id = %s", [i])
    assert dispatcher.deliver(i, _claim(django_db, i)) == Outcome.DONE
    assert _committed(django_db, "SELECT total FROM testapp_order") == [(2,)]
