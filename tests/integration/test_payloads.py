"""Payloads through PostgreSQL (DESIGN invariant 27): whatever kind of connection enqueued it,
one at a time or many at once, the fenced start of a one-row delivery and of a batch hands the
handler what was enqueued, as a Celery task argument would come back: key order, number types,
kombu's registered types. Property-based over JSON values and those types (Hypothesis).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from psycopg_pool import ConnectionPool
from support import steps
from support.payloads import PAYLOADS, same

from outbox_celery import (
    Event,
    ProducerError,
    Store,
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
)
from outbox_celery.config import OutboxConfig
from outbox_celery.handlers import HandlerSpec
from outbox_celery.message import Message
from outbox_celery.testing import InProcess
from outbox_celery.transactional import PsycopgTransaction

from .helpers import LONG
from .producer_kinds import ASYNC_KINDS, SYNC_KINDS

ORDER = {"event_type": "order.created", "aggregate_type": "order", "aggregate_id": "42"}

# The report's cases and one of each registered type.
SENT: list[Any] = [
    {"b": 1, "a": 2},
    1e20,
    Decimal("1.10"),
    {"total": Decimal("19.990"), "at": datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=timezone(timedelta(hours=2)))},
    [uuid.UUID(int=42), date(2026, 1, 2), time(23, 59), b"\x00\xff", datetime(2026, 1, 2)],
    "1",
    {"z": {"y": 1.0, "x": -0.0}, "n": 10**25},
]


def _start_all(
    conn: psycopg.Connection[Any], table: str, ids: list[int], *, batch: bool
) -> dict[int, Message]:
    """Claim and start ``ids`` as a one-row delivery (or one batch) would."""
    store = Store(table)
    claimed = steps.claim(store, conn, limit=len(ids) + 10, lease=LONG, owner="w", max_attempts=5).claimed
    pairs = [(c.id, c.lease_version) for c in claimed if c.id in ids]
    assert sorted(i for i, _ in pairs) == sorted(ids)
    if batch:
        return {
            m.id: m for m in steps.start_many(store, conn, pairs, lease=LONG, max_attempts=5, starter="t")
        }
    started = {}
    for outbox_id, version in pairs:
        msg = steps.start(store, conn, outbox_id, version, lease=LONG, max_attempts=5)
        assert msg is not None
        started[outbox_id] = msg
    return started


def _check(conn: psycopg.Connection[Any], table: str, ids: list[int], sent: list[Any], batch: bool) -> None:
    got = _start_all(conn, table, ids, batch=batch)
    for outbox_id, value in zip(ids, sent, strict=True):
        assert same(value, got[outbox_id].payload), (value, got[outbox_id].payload)


@pytest.mark.parametrize("batch", [False, True], ids=["one-row", "batch"])
@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_invariant_27_each_kind_hands_over_what_was_enqueued(
    kind: str, batch: bool, migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    with SYNC_KINDS[kind](migrated_dsn) as h:
        ids = [enqueue(h.conn, payload=value, table=table, **ORDER) for value in SENT]
        ids += enqueue_many(h.conn, [Event("e", value, "a", 1) for value in SENT], table=table)
        h.commit()
    _check(conn, table, ids, SENT + SENT, batch)


@pytest.mark.parametrize("kind", ASYNC_KINDS)
def test_invariant_27_each_async_kind_hands_over_what_was_enqueued(
    kind: str, migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    async def main() -> list[int]:
        async with ASYNC_KINDS[kind](migrated_dsn) as h:
            ids = [await enqueue_async(h.conn, payload=value, table=table, **ORDER) for value in SENT]
            ids += await enqueue_many_async(h.conn, [Event("e", v, "a", 1) for v in SENT], table=table)
            await h.commit()
            return ids

    _check(conn, table, asyncio.run(main()), SENT + SENT, batch=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=PAYLOADS)
def test_invariant_27_any_payload_comes_back_through_the_table(
    value: Any, conn: psycopg.Connection[Any], table: str
) -> None:
    with conn.transaction():
        outbox_id = enqueue(conn, payload=value, table=table, **ORDER)
    assert same(value, _start_all(conn, table, [outbox_id], batch=False)[outbox_id].payload)
    conn.execute(f"DELETE FROM {table}")  # the next example claims only its own row


def test_invariant_27_the_stored_text_is_kombus_json_and_searchable(
    conn: psycopg.Connection[Any], table: str
) -> None:
    with conn.transaction():
        outbox_id = enqueue(conn, payload={"b": 1e20, "amount": Decimal("1.10")}, table=table, **ORDER)
    row = conn.execute(
        f"SELECT payload::text, payload->'amount'->>'__value__', payload::jsonb @> '{{\"b\": 1e20}}'"
        f" FROM {table} WHERE id = %s",
        [outbox_id],
    ).fetchone()
    assert row == ('{"b":1e+20,"amount":{"__type__":"decimal","__value__":"1.10"}}', "1.10", True)
    assert json.loads(row[0])["b"] == 1e20


def test_invariant_27_a_payload_that_would_change_is_refused_before_anything_is_written(
    conn: psycopg.Connection[Any], table: str
) -> None:
    with conn.transaction():
        with pytest.raises(ProducerError, match="two keys become one"):
            enqueue(conn, payload={1: "a", "1": "b"}, table=table, **ORDER)
        with pytest.raises(ProducerError, match=r"message 1: .*would not come back as itself"):
            enqueue_many(
                conn,
                [Event("e", {}, "a", 1), Event("e", {"__type__": "uuid", "__value__": 1}, "a", 1)],
                table=table,
            )
    assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)


@pytest.mark.parametrize("how", ["plain", "transactional", "batch"])
def test_invariant_27_every_handler_kind_receives_what_was_enqueued(
    how: str, migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    seen: dict[int, Any] = {}

    def plain(message: Message) -> None:
        seen[message.id] = message.payload

    def transactional(message: Message, tx: Any) -> None:
        seen[message.id] = message.payload

    def batch(messages: list[Message]) -> None:
        seen.update({m.id: m.payload for m in messages})

    spec = {
        "plain": HandlerSpec("e", plain, "q"),
        "transactional": HandlerSpec("e", transactional, "q", transaction=PsycopgTransaction()),
        "batch": HandlerSpec("e", batch, "q", batch=10),
    }[how]
    with conn.transaction():
        ids = enqueue_many(conn, [Event("e", value, "a", 1) for value in SENT], table=table)
    with ConnectionPool(migrated_dsn, min_size=1, max_size=4, kwargs={"autocommit": True}, open=True) as pool:
        dispatcher = InProcess(
            OutboxConfig(table=table, lease=LONG, done_batch_delay=0), pool.connection, {"e": spec}
        )
        claimed = steps.claim(Store(table), conn, limit=50, lease=LONG, owner="w", max_attempts=5).claimed
        pairs = [(c.id, c.lease_version) for c in claimed]
        if how == "batch":
            dispatcher.deliver_batch(pairs)
        else:
            for outbox_id, version in pairs:
                dispatcher.deliver(outbox_id, version)
    for outbox_id, value in zip(ids, SENT, strict=True):
        assert same(value, seen[outbox_id]), (value, seen[outbox_id])
