"""Migration 0006 (the table's identity) applied to a table of the previous schema holding
rows in every state: pending, processing with a live and an expired lease, done, dead, ordered
and not. Nothing of those rows changes, the dispatcher still works on them, and their messages
get idempotency keys that carry the new identity (DESIGN invariant 11).
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql
from support import steps

from outbox_celery import Store, TableName, enqueue, migrate
from outbox_celery.db.migrations import applied_versions, available

from .helpers import LONG
from .test_migrations import schema_dump
from .upgrade import TABLE, claim_old_rows, old_columns, previous_schema, rows

VERSION = 6


def test_invariant_11_migration_0006_from_the_previous_schema_with_rows_in_every_state(
    conn: psycopg.Connection[Any], table: str
) -> None:
    previous = previous_schema(conn, VERSION)
    t = TableName.parse(TABLE).identifier()
    before = rows(conn)
    legacy = Store(TABLE)
    assert legacy.instance(conn) is None  # before 0006: the previous key form, said in the log

    assert migrate(conn, TABLE) == [m.version for m in available() if m.version > previous]
    assert VERSION in applied_versions(conn, TABLE)
    assert old_columns(rows(conn), before) == before
    assert schema_dump(conn, TABLE) == schema_dump(conn, table)
    assert schema_dump(conn, "events.upgraded_instance") == schema_dump(conn, f"{table}_instance")

    # The dispatcher still works on the old rows, and their keys carry the identity now.
    store = Store(TABLE)
    claimed = claim_old_rows(conn, store, before)
    instance = store.instance(conn)
    assert instance is not None and instance != Store(table).instance(conn)
    row = conn.execute(sql.SQL("SELECT lease_version FROM {} WHERE id = %s").format(t), [min(claimed)])
    version = row.fetchone()
    assert version is not None
    msg = steps.start(store, conn, min(claimed), version[0], lease=LONG, max_attempts=12)
    assert msg is not None
    assert msg.idempotency_key == f"{instance}/events.upgraded:{msg.id}"
    assert msg.legacy_idempotency_key == f"events.upgraded:{msg.id}"
    # Drawn once: migrating again keeps it.
    assert migrate(conn, TABLE) == []
    assert Store(TABLE).instance(conn) == instance


def test_invariant_11_a_worker_role_that_may_not_read_the_identity_still_delivers_and_says_why(
    conn: psycopg.Connection[Any], table: str, migrated_dsn: str, caplog: Any
) -> None:
    # A worker role granted the outbox table only (the identity's table is new in 0006): its
    # deliveries go on with keys of the previous form, and the log says which GRANT is missing,
    # rather than every fenced start failing on "permission denied".
    import logging

    from psycopg.conninfo import make_conninfo

    role = "outbox_worker_0006"
    conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(sql.Identifier(role)))
        conn.execute(
            sql.SQL("GRANT SELECT, UPDATE ON {} TO {}").format(sql.Identifier(table), sql.Identifier(role))
        )
        with conn.transaction():
            enqueue(conn, event_type="e", payload={}, aggregate_type="a", aggregate_id=1, table=table)
        [c] = steps.claim(Store(table), conn, limit=1, lease=LONG, owner="w", max_attempts=3).claimed
        with psycopg.connect(make_conninfo(migrated_dsn, user=role), autocommit=True) as worker:
            store = Store(table)
            with caplog.at_level(logging.ERROR, logger="outbox_celery.db.store"):
                msg = steps.start(store, worker, c.id, c.lease_version, lease=LONG, max_attempts=3)
            assert msg is not None
            assert msg.idempotency_key == f"public.{table}:{c.id}"
            assert f'GRANT SELECT ON "{table}_instance"' in caplog.text
    finally:
        conn.execute(sql.SQL("REASSIGN OWNED BY {} TO CURRENT_USER").format(sql.Identifier(role)))
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
