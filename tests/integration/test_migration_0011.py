"""Migration 0011 (subscriptions, DESIGN invariant 28) applied to a table of the previous schema
holding rows in every state: every row keeps its columns and payload (no reference, nothing
rewritten), the schema is exactly the fresh one, the dispatcher hands the old rows over as
before, and once a subscription is added the table fans events out.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql
from support import steps

from outbox_celery import Store, TableName, enqueue, migrate
from outbox_celery.db.migrations import applied_versions, available
from outbox_celery.ops import subscriptions

from .helpers import LONG
from .test_migrations import schema_dump
from .upgrade import TABLE, claim_old_rows, old_columns, previous_schema, rows

VERSION = 11


def test_invariant_28_migration_0011_from_the_previous_schema_with_rows_in_every_state(
    conn: psycopg.Connection[Any], table: str
) -> None:
    previous = previous_schema(conn, VERSION)
    before = rows(conn)
    assert {r["status"] for r in before} == {"pending", "processing", "done", "dead"}

    assert migrate(conn, TABLE) == [m.version for m in available() if m.version > previous]
    assert VERSION in applied_versions(conn, TABLE)
    after = rows(conn)
    assert old_columns(after, before) == before
    assert all(r["payload_of"] is None for r in after)
    assert schema_dump(conn, TABLE) == schema_dump(conn, table)
    assert subscriptions.list_subscriptions(conn, TABLE) == []

    # The dispatcher hands the old rows over as the previous release did.
    store = Store(TABLE)
    for outbox_id in claim_old_rows(conn, store, before):
        version = next(r for r in rows(conn) if r["id"] == outbox_id)["lease_version"]
        msg = steps.start(store, conn, outbox_id, version, lease=LONG, max_attempts=12)
        assert msg is not None and msg.payload == {} and msg.subscription is None

    # Old rows of event type "e" stay as they are; new events of "e" fan out.
    subscriptions.add(conn, TABLE, "e", "one")
    subscriptions.add(conn, TABLE, "e", "two")
    with conn.transaction():
        enqueue(conn, payload=1, table=TABLE, event_type="e", aggregate_type="order", aggregate_id="1")
    new = [r for r in rows(conn) if r["id"] > max(b["id"] for b in before)]
    assert [(r["event_type"], r["payload"]) for r in new] == [("e@one", 1), ("e@two", None)]
    assert migrate(conn, TABLE) == []


def test_invariant_28_migration_0011_refuses_while_unfinished_rows_have_an_at_in_their_event_type(
    conn: psycopg.Connection[Any],
) -> None:
    """Such a row would be read as a subscription's route: the migration names how many and
    one of them, and changes nothing; done rows do not count."""
    previous_schema(conn, VERSION)
    old = rows(conn)
    t = TableName.parse(TABLE).identifier()
    held = [r["id"] for r in old if r["status"] in ("pending", "dead")]
    done = [r["id"] for r in old if r["status"] == "done"]
    update = sql.SQL("UPDATE {} SET event_type = %s WHERE id = ANY(%s)").format(t)
    conn.execute(update, ["mail@legacy", held])
    conn.execute(update, ["mail@done", done])
    with pytest.raises(psycopg.Error) as refused:
        migrate(conn, TABLE)
    message = str(refused.value)
    assert f"migration 0011: {len(held)} unfinished row(s) have an event type containing @" in message
    assert "(for example 'mail@legacy')" in message and "subscription's route" in message
    assert VERSION not in applied_versions(conn, TABLE)
    assert subscriptions.list_subscriptions(conn, TABLE) == []  # no subscription table
    assert rows(conn) == [
        {
            **r,
            "event_type": "mail@legacy"
            if r["id"] in held
            else "mail@done"
            if r["id"] in done
            else r["event_type"],
        }
        for r in old
    ]

    # Renamed (or finished), the migration runs; the done rows keep their event type.
    conn.execute(update, ["mail.legacy", held])
    assert VERSION in migrate(conn, TABLE)
