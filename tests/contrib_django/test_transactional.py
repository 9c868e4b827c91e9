"""``transactional="django"`` (#24, DESIGN invariant 20): the ORM's writes, the follow-up event and
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

from outbox_celery import Message, OutboxConfig, RetryableError, Store, enqueue
from outbox_celery.dispatch import Dispatcher, HandlerSpec, Outcome
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
    dispatcher = Dispatcher(OutboxConfig(lease=60.0), pool.connection, {EVENT: spec})
    store = Store()
    with psycopg.connect(django_db, autocommit=True) as c:
        with c.transaction():
            i = enqueue(c, event_type=EVENT, payload={}, aggregate_type="order", aggregate_id="1")
        for expected in (Outcome.RETRY, Outcome.DONE):
            [claim] = store.claim(
                c, limit=1, lease=60.0, owner="w", max_attempts=5, event_types=[EVENT]
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
