"""The upgrade harness of the migration tests: a table as the release before a migration left it,
holding a row in every state (pending, processing under a live and an expired lease, done,
dead, ordered and not), and the check that the dispatcher still works on those rows.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from outbox_celery import Store, TableName
from outbox_celery.db.migrations import available

from .helpers import LONG, claim_ids
from .test_migrations import _replay_up_to

TABLE = "events.upgraded"

# (status, ordering_key, lease_until relative to now, attempts)
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

# Columns later migrations added, with the value each row of STATES gets: the version that added
# the column, and its value as an SQL expression over the row's parameters.
_LATER_COLUMNS = [
    # A claim with attempts was started (as migration 0003 leaves it).
    (3, "started_version", "%(started)s"),
    # Each key here has one unfinished message, its head (as migration 0004 leaves it).
    (4, "head", "%(key)s::text IS NOT NULL AND %(status)s <> 'done'"),
    (5, "dedup_key", "'d' || %(i)s"),
]


def rows(conn: psycopg.Connection[Any], table: str = TABLE) -> list[dict[str, Any]]:
    """Every row of ``table``, by id."""
    t = TableName.parse(table).identifier()
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(sql.SQL("SELECT * FROM {} ORDER BY id").format(t)).fetchall()


def old_columns(after: list[dict[str, Any]], before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``after`` with only the columns ``before`` had (later migrations add columns)."""
    names = set(before[0]) if before else set()
    return [{k: v for k, v in r.items() if k in names} for r in after]


def previous_schema(conn: psycopg.Connection[Any], version: int) -> int:
    """Build :data:`TABLE` with the migrations before ``version``, one row of each of
    :data:`STATES` in it; return the version it was left at."""
    previous = max(m.version for m in available() if m.version < version)
    _replay_up_to(conn, TABLE, previous)
    later = [(name, value) for added, name, value in _LATER_COLUMNS if added <= previous]
    insert = sql.SQL(
        "INSERT INTO {} (event_type, aggregate_type, aggregate_id, payload, ordering_key, status,"
        " attempts, lease_version, lease_until, lease_owner, done_at, last_error{})"
        " VALUES ('e', 'order', %(i)s, '{{}}', %(key)s, %(status)s, %(attempts)s, %(version)s,"
        " now() + %(lease)s::interval,"
        " CASE WHEN %(status)s = 'processing' THEN 'w1' END,"
        " CASE WHEN %(status)s = 'done' THEN now() END,"
        " CASE WHEN %(status)s = 'dead' THEN 'boom' END{})"
    ).format(
        TableName.parse(TABLE).identifier(),
        sql.SQL("").join(sql.SQL(", ") + sql.Identifier(name) for name, _ in later),
        sql.SQL("").join(sql.SQL(", " + value) for _, value in later),
    )
    for i, (status, key, lease, attempts) in enumerate(STATES):
        version = 1 if status != "pending" else 0
        params = {"i": str(i), "key": key, "status": status, "attempts": attempts, "lease": lease}
        conn.execute(insert, {**params, "version": version, "started": version if attempts else 0})
    return previous


def claim_old_rows(conn: psycopg.Connection[Any], store: Store, old_rows: list[dict[str, Any]]) -> set[int]:
    """Claim on the upgraded table and check what comes back: the unordered pending row, the
    pending head of order:1 and the expired lease; not the live lease, done or dead rows.
    Returns the claimed ids."""
    by_key = {(r["status"], r["ordering_key"], r["lease_until"] is not None): r["id"] for r in old_rows}
    claimed = set(claim_ids(store, conn, lease=LONG, max_attempts=12))
    assert claimed == {
        by_key[("pending", None, False)],
        by_key[("pending", "order:1", False)],
        by_key[("processing", "order:2", True)],
    }
    return claimed
