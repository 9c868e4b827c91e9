"""Migration 0008 (limit keys) applied to a table of the previous schema holding rows in
every state: pending, processing with a live and an expired lease, done, dead, ordered and not.
Nothing of those rows changes (their limit key is NULL), the new indexes, column and table are
exactly the fresh schema's, and the dispatcher still works on the old rows, with limits per key
declared and a producer giving keys (DESIGN invariant 24).
"""

from __future__ import annotations

from typing import Any

import psycopg
from support import steps

from outbox_celery import Store, enqueue, migrate
from outbox_celery.db.migrations import applied_versions, available
from outbox_celery.flow import Limit

from .helpers import LONG
from .test_migrations import schema_dump
from .upgrade import TABLE, claim_old_rows, old_columns, previous_schema, rows

VERSION = 8


def test_invariant_24_migration_0008_from_the_previous_schema_with_rows_in_every_state(
    conn: psycopg.Connection[Any], table: str
) -> None:
    previous = previous_schema(conn, VERSION)
    before = rows(conn)

    assert migrate(conn, TABLE) == [m.version for m in available() if m.version > previous]
    assert VERSION in applied_versions(conn, TABLE)
    after = rows(conn)
    assert [r.pop("limit_key") for r in after] == [None] * len(before)
    assert old_columns(after, before) == before  # later migrations add columns
    assert schema_dump(conn, TABLE) == schema_dump(conn, table)
    assert schema_dump(conn, f"{TABLE}_flow") == schema_dump(conn, f"{table}_flow")
    assert schema_dump(conn, f"{TABLE}_flow_key") == schema_dump(conn, f"{table}_flow_key")

    # The dispatcher works on the old rows (no key), and limits per key on new rows.
    store = Store(TABLE)
    claim_old_rows(conn, store, before)
    # New rows with keys: at most key_concurrency of each key claimed.
    with conn.transaction():
        for key in ["t1", "t1", "t1", "t2"]:
            enqueue(
                conn,
                event_type="e",
                payload={},
                aggregate_type="a",
                aggregate_id=1,
                table=TABLE,
                limit_key=key,
            )
    result = steps.claim(
        store, conn, limit=10, lease=LONG, owner="w", max_attempts=12, limits={"e": Limit(key_concurrency=2)}
    )
    assert len(result.claimed) == 3
    assert migrate(conn, TABLE) == []
