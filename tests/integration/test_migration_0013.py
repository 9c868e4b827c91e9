"""Migration 0013 (every failed attempt recorded, DESIGN invariant 32) applied to a table of the
previous schema holding rows in every state: every row is kept as it was with no recorded
attempt, the schema is exactly the fresh one, the dispatcher hands the old rows over and
finishes them, and a failure after the migration appends to ``errors``.
"""

from __future__ import annotations

from typing import Any

import psycopg
from support import steps

from outbox_celery import Store, migrate
from outbox_celery.db.migrations import applied_versions, available

from .helpers import LONG, fetch
from .test_migrations import schema_dump
from .upgrade import TABLE, claim_old_rows, old_columns, previous_schema, rows

VERSION = 13
LEASE_LOST = "lease expired without a result (worker lost or timed out)"


def test_invariant_32_migration_0013_from_the_previous_schema_with_rows_in_every_state(
    conn: psycopg.Connection[Any], table: str
) -> None:
    previous = previous_schema(conn, VERSION)
    before = rows(conn)
    assert {r["status"] for r in before} == {"pending", "processing", "done", "dead"}

    assert migrate(conn, TABLE) == [m.version for m in available() if m.version > previous]
    assert VERSION in applied_versions(conn, TABLE)
    after = rows(conn)
    assert old_columns(after, before) == before
    assert {r["errors"] for r in after} == {None}
    assert schema_dump(conn, TABLE) == schema_dump(conn, table)

    # The old rows are claimed, started and finished as before. The expired lease was started
    # (attempt 2): its re-claim records that attempt; the others have no entry.
    store = Store(TABLE)
    claimed = claim_old_rows(conn, store, before)
    expired = next(r["id"] for r in before if r["status"] == "processing" and r["ordering_key"] == "order:2")
    for outbox_id in claimed:
        errors = fetch(conn, TABLE, outbox_id)["errors"]
        if outbox_id == expired:
            assert [(e["attempt"], e["error"]) for e in errors] == [(2, LEASE_LOST)]
        else:
            assert errors is None
        version = fetch(conn, TABLE, outbox_id)["lease_version"]
        assert steps.start(store, conn, outbox_id, version, lease=LONG, max_attempts=12) is not None
        if outbox_id == expired:
            assert steps.done(store, conn, outbox_id, version)
        else:
            # A failure after the migration appends to errors.
            failed = steps.retry(store, conn, outbox_id, version, delay=60, error="HTTP 503", max_attempts=12)
            assert failed.status == "pending"
            row = fetch(conn, TABLE, outbox_id)
            assert [(e["attempt"], e["error"]) for e in row["errors"]] == [(row["attempts"], "HTTP 503")]
    assert migrate(conn, TABLE) == []
