"""Migration 0005 (dedup_key, trace_context) applied to a table of the previous schema holding
rows in every state: pending, processing with a live and an expired lease, done, dead, ordered
and not. Nothing of those rows changes, the dispatcher still works on them, and the new columns
work on the upgraded table.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from outbox_celery import Store, TableName, enqueue, migrate
from outbox_celery.migrations import applied_versions, available

from .helpers import LONG, claim_ids
from .test_migrations import _replay_up_to, schema_dump

VERSION = 5
TABLE = "events.upgraded"

# (status, ordering_key, lease_until relative to now, attempts, done_at?)
STATES = [
    ("pending", None, None, 0),
    ("pending", "order:1", None, 1),
    ("processing", None, "60 seconds", 1),  # live lease
    ("processing", "order:2", "-60 seconds", 2),  # expired lease
    ("done", None, None, 1),
    ("done", "order:1", None, 1),
    ("dead", None, None, 12),
    ("dead", "order:3", None, 12),
]


def _rows(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    t = TableName.parse(TABLE).identifier()
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(sql.SQL("SELECT * FROM {} ORDER BY id").format(t)).fetchall()


def test_migration_0005_from_the_previous_schema_with_rows_in_every_state(
    conn: psycopg.Connection[Any], table: str
) -> None:
    previous = max(m.version for m in available() if m.version < VERSION)
    _replay_up_to(conn, TABLE, previous)
    t = TableName.parse(TABLE).identifier()
    insert = sql.SQL(
        "INSERT INTO {} (event_type, aggregate_type, aggregate_id, payload, ordering_key, status,"
        " attempts, lease_version, lease_until, lease_owner, done_at, last_error,"
        " started_version, head)"
        " VALUES ('e', 'order', %s, '{{}}', %s, %s, %s, %s,"
        " CASE WHEN %s::interval IS NULL THEN NULL ELSE now() + %s::interval END,"
        " CASE WHEN %s = 'processing' THEN 'w1' END,"
        " CASE WHEN %s = 'done' THEN now() END,"
        " CASE WHEN %s = 'dead' THEN 'boom' END,"
        # As versions 3 and 4 leave them: a claim with attempts was started; each key here has
        # one unfinished message, its head.
        " CASE WHEN %s > 0 THEN %s ELSE 0 END, %s::text IS NOT NULL AND %s <> 'done')"
    ).format(t)
    for i, (status, key, lease, attempts) in enumerate(STATES):
        version = 1 if status != "pending" else 0
        conn.execute(
            insert,
            [
                str(i),
                key,
                status,
                attempts,
                version,
                lease,
                lease,
                status,
                status,
                status,
                attempts,
                version,
                key,
                status,
            ],
        )
    before = _rows(conn)

    assert migrate(conn, TABLE) == [m.version for m in available() if m.version > previous]
    assert VERSION in applied_versions(conn, TABLE)
    after = _rows(conn)
    assert [{k: v for k, v in r.items() if k not in ("dedup_key", "trace_context")} for r in after] == before
    assert all(r["dedup_key"] is None and r["trace_context"] is None for r in after)
    assert schema_dump(conn, TABLE) == schema_dump(conn, table)

    # The dispatcher still works on the old rows: the unordered pending row and the expired
    # lease come back; the live lease, done and dead rows do not; order:1's head is pending.
    by_key = {(r["status"], r["ordering_key"], r["lease_until"] is not None): r["id"] for r in before}
    claimed = set(claim_ids(Store(TABLE), conn, lease=LONG, max_attempts=12))
    assert claimed == {
        by_key[("pending", None, False)],
        by_key[("pending", "order:1", False)],
        by_key[("processing", "order:2", True)],
    }

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
