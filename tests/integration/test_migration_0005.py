"""Migration 0005 (dedup_key, trace_context) applied to a table of the previous schema holding
rows in every state: pending, processing with a live and an expired lease, done, dead, ordered
and not. Nothing of those rows changes, the dispatcher still works on them, and the new columns
work on the upgraded table.
"""

from __future__ import annotations

from typing import Any

import psycopg

from outbox_celery import Store, enqueue, migrate
from outbox_celery.db.migrations import applied_versions, available

from .test_migrations import schema_dump
from .upgrade import TABLE, claim_old_rows, old_columns, previous_schema, rows

VERSION = 5


def test_migration_0005_from_the_previous_schema_with_rows_in_every_state(
    conn: psycopg.Connection[Any], table: str
) -> None:
    previous = previous_schema(conn, VERSION)
    before = rows(conn)

    assert migrate(conn, TABLE) == [m.version for m in available() if m.version > previous]
    assert VERSION in applied_versions(conn, TABLE)
    after = rows(conn)
    assert old_columns(after, before) == before
    assert all(r["dedup_key"] is None and r["trace_context"] is None for r in after)
    assert schema_dump(conn, TABLE) == schema_dump(conn, table)

    # The dispatcher still works on the old rows.
    claim_old_rows(conn, Store(TABLE), before)

    # The new columns work on the upgraded table.
    with conn.transaction():
        first = enqueue(
            conn, event_type="e", payload={}, aggregate_type="a", aggregate_id=1, table=TABLE, dedup_key="k"
        )
    with conn.transaction():
        again = enqueue(
            conn, event_type="e", payload={}, aggregate_type="a", aggregate_id=1, table=TABLE, dedup_key="k"
        )
    assert again == first
