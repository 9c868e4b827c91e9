"""Migration 0007 (flow control) applied to a table of the previous schema holding rows in
every state: pending, processing with a live and an expired lease, done, dead, ordered and not.
Nothing of those rows changes, the new table beside it is exactly the fresh schema's, and the
dispatcher still works on the old rows, pauses and limits included (DESIGN invariants 22, 23).
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from support import steps

from outbox_celery import Store, TableName, migrate, ops
from outbox_celery.db.migrations import applied_versions, available
from outbox_celery.flow import Limit

from .helpers import LONG
from .test_migrations import _replay_up_to, schema_dump

VERSION = 7
TABLE = "events.upgraded"

# (event type, status, ordering_key, lease_until relative to now, attempts)
STATES = [
    ("a", "pending", None, None, 0),
    ("a", "pending", "order:1", None, 1),
    ("a", "processing", None, "60 seconds", 1),  # live lease
    ("b", "processing", "order:2", "-60 seconds", 2),  # expired lease, started
    ("b", "pending", None, None, 0),
    ("a", "done", None, None, 1),
    ("b", "done", "order:1", None, 1),
    ("a", "dead", None, None, 12),
    ("b", "dead", "order:3", None, 12),
]


def _rows(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    t = TableName.parse(TABLE).identifier()
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(sql.SQL("SELECT * FROM {} ORDER BY id").format(t)).fetchall()


def test_invariant_23_migration_0007_from_the_previous_schema_with_rows_in_every_state(
    conn: psycopg.Connection[Any], table: str
) -> None:
    previous = max(m.version for m in available() if m.version < VERSION)
    _replay_up_to(conn, TABLE, previous)
    t = TableName.parse(TABLE).identifier()
    insert = sql.SQL(
        "INSERT INTO {} (event_type, aggregate_type, aggregate_id, payload, ordering_key, status,"
        " attempts, lease_version, started_version, lease_until, lease_owner, done_at, last_error,"
        " head)"
        " VALUES (%(type)s, 'order', %(i)s, '{{}}', %(key)s, %(status)s, %(attempts)s, %(version)s,"
        " %(started)s, now() + %(lease)s::interval,"
        " CASE WHEN %(status)s = 'processing' THEN 'w1' END,"
        " CASE WHEN %(status)s = 'done' THEN now() END,"
        " CASE WHEN %(status)s = 'dead' THEN 'boom' END,"
        " %(key)s::text IS NOT NULL AND %(status)s <> 'done')"
    ).format(t)
    for i, (type_, status, key, lease, attempts) in enumerate(STATES):
        version = 1 if status != "pending" else 0
        params = {"i": str(i), "type": type_, "key": key, "status": status, "attempts": attempts}
        conn.execute(insert, {**params, "lease": lease, "version": version, "started": version})
    before = _rows(conn)
    # Before 0007: claims run without flow control (logged), stats show no pause.
    assert ops.stats(conn, TABLE).flow == []

    assert migrate(conn, TABLE) == [m.version for m in available() if m.version > previous]
    assert VERSION in applied_versions(conn, TABLE)
    # Later migrations add columns (0008: limit_key, 0011: payload_of, 0012: group_id, 0013:
    # errors, NULL on old rows).
    new = ("limit_key", "payload_of", "group_id", "errors")
    assert [{k: v for k, v in r.items() if k not in new} for r in _rows(conn)] == before
    assert schema_dump(conn, TABLE) == schema_dump(conn, table)
    assert schema_dump(conn, f"{TABLE}_flow") == schema_dump(conn, f"{table}_flow")

    # The dispatcher works on the old rows, and a pause and a limit hold on them.
    by = {(r["event_type"], r["status"], r["ordering_key"]): r["id"] for r in before}
    store = Store(TABLE)
    assert ops.pause(conn, TABLE, "b")
    result = steps.claim(
        store, conn, limit=10, lease=LONG, owner="w", max_attempts=12, limits={"a": Limit(concurrency=2)}
    )
    # a: one live lease already, so one more of its two claimable rows; b: paused.
    assert len(result.claimed) == 1
    assert result.claimed[0].id in {by[("a", "pending", None)], by[("a", "pending", "order:1")]}
    assert result.held == ("b",)
    ops.resume(conn, TABLE, "b")
    again = steps.claim(store, conn, limit=10, lease=LONG, owner="w", max_attempts=12)
    assert {c.id for c in again.claimed} >= {by[("b", "processing", "order:2")], by[("b", "pending", None)]}
    assert migrate(conn, TABLE) == []
