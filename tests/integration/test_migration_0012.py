"""Migration 0012 (groups with a callback, DESIGN invariant 29) applied to a table of the previous
schema holding rows in every state: every row is kept as it was and belongs to no group, the
schema is exactly the fresh one, the dispatcher hands the old rows over and finishes them (no
group counted), and a group written after the migration completes with its callback.
"""

from __future__ import annotations

from typing import Any

import psycopg
from support import steps

from outbox_celery import Event, Store, group, migrate
from outbox_celery.db.migrations import applied_versions, available

from .helpers import LONG, fetch
from .test_migrations import schema_dump
from .upgrade import TABLE, claim_old_rows, old_columns, previous_schema, rows

VERSION = 12


def test_invariant_29_migration_0012_from_the_previous_schema_with_rows_in_every_state(
    conn: psycopg.Connection[Any], table: str
) -> None:
    previous = previous_schema(conn, VERSION)
    before = rows(conn)
    assert {r["status"] for r in before} == {"pending", "processing", "done", "dead"}

    assert migrate(conn, TABLE) == [m.version for m in available() if m.version > previous]
    assert VERSION in applied_versions(conn, TABLE)
    after = rows(conn)
    assert old_columns(after, before) == before
    assert {r["group_id"] for r in after} == {None}
    assert schema_dump(conn, TABLE) == schema_dump(conn, table)

    # The old rows are claimed, started and finished as before: no group counts them.
    store = Store(TABLE)
    for outbox_id in claim_old_rows(conn, store, before):
        version = fetch(conn, TABLE, outbox_id)["lease_version"]
        assert steps.start(store, conn, outbox_id, version, lease=LONG, max_attempts=12) is not None
        assert steps.done(store, conn, outbox_id, version)
    assert conn.execute(f"SELECT count(*) FROM {TABLE}_group").fetchone() == (0,)

    # A group written after the migration completes with its callback.
    with conn.transaction():
        g = group(conn, [Event("part", {"i": 1}, "p", 1)], then=Event("cb", {}, "p", 0), table=TABLE)
    [c] = steps.claim(store, conn, limit=10, lease=LONG, owner="t", max_attempts=12).claimed
    assert c.id == g.member_ids[0]
    assert steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=12) is not None
    assert steps.done(store, conn, c.id, c.lease_version)
    cb = conn.execute(f"SELECT payload FROM {TABLE} WHERE event_type = 'cb'").fetchone()
    assert cb is not None and cb[0]["outbox_group"]["done"] == 1
    assert migrate(conn, TABLE) == []
