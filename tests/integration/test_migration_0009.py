"""Migration 0009 (flow control's bounds, DESIGN invariant 25) applied to a table of the previous
schema holding rows in every state, and its per-key flow state in every state: a paused key, a
key held until later, a hold that ran out, a key_rate bucket, a bucket of a held key. Nothing of
those rows changes, the new column and index are exactly the fresh schema's, the claim and the
prune work on them: a bucket written before the migration (no full_at) is kept, as its rate is
not known; a key with nothing left is pruned.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from support import steps

from outbox_celery import Store, TableName, enqueue, migrate, ops
from outbox_celery.db.migrations import applied_versions, available
from outbox_celery.flow import Limit

from .helpers import LONG
from .test_migrations import schema_dump
from .upgrade import TABLE, claim_old_rows, old_columns, previous_schema, rows

VERSION = 9

# (limit_key, paused, paused_until relative to now, tokens)
KEY_STATES = [
    ("paused", True, None, None),
    ("held", False, "1 hour", None),
    ("ran-out", False, "-1 hour", None),
    ("bucket", False, None, 0.5),
    ("held-bucket", False, "1 hour", 0.0),
]


def _key_rows(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    t = TableName.parse(TABLE).identifier("_flow_key")
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(sql.SQL("SELECT * FROM {} ORDER BY limit_key").format(t)).fetchall()


def test_invariant_25_migration_0009_from_the_previous_schema_with_rows_in_every_state(
    conn: psycopg.Connection[Any], table: str
) -> None:
    previous = previous_schema(conn, VERSION)
    flow_key = TableName.parse(TABLE).identifier("_flow_key")
    for key, paused, until, tokens in KEY_STATES:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (event_type, limit_key, paused, paused_until, tokens, refilled_at,"
                " updated_at)"
                " VALUES ('e', %s, %s, now() + %s::interval, %s,"
                " CASE WHEN %s::float8 IS NOT NULL THEN now() END, now() - interval '1 hour')"
            ).format(flow_key),
            [key, paused, until, tokens, tokens],
        )
    before, keys_before = rows(conn), _key_rows(conn)

    assert migrate(conn, TABLE) == [m.version for m in available() if m.version > previous]
    assert VERSION in applied_versions(conn, TABLE)
    assert old_columns(rows(conn), before) == before  # later migrations add columns
    keys_after = _key_rows(conn)
    assert [k.pop("full_at") for k in keys_after] == [None] * len(keys_before)
    assert keys_after == keys_before
    assert schema_dump(conn, TABLE) == schema_dump(conn, table)
    assert schema_dump(conn, f"{TABLE}_flow") == schema_dump(conn, f"{table}_flow")
    assert schema_dump(conn, f"{TABLE}_flow_key") == schema_dump(conn, f"{table}_flow_key")

    # The dispatcher works on the old rows; the held and paused keys stay held.
    store = Store(TABLE)
    claim_old_rows(conn, store, before)
    with conn.transaction():
        for key in ["paused", "held", "ran-out", "bucket", "held-bucket"]:
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
    assert len(result.claimed) == 2  # ran-out and bucket
    # The prune: the hold that ran out goes; the buckets written before the migration stay.
    conn.execute(sql.SQL("UPDATE {} SET updated_at = now() - interval '1 hour'").format(flow_key))
    assert ops.prune_flow_keys(conn, TABLE) == 1
    assert [k["limit_key"] for k in _key_rows(conn)] == ["bucket", "held", "held-bucket", "paused"]
    assert migrate(conn, TABLE) == []
