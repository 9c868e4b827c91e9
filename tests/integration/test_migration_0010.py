"""Migration 0010 (the payload kept as its ``json`` text, DESIGN invariant 27) applied to a table
of the previous schema holding rows in every state, with payloads of every JSON shape: every row
decodes as the previous release decoded it (psycopg's ``jsonb`` loader), the column is exactly
the fresh schema's, and the dispatcher hands the old rows over unchanged. An unfinished row whose
payload holds a ``{"__type__", "__value__"}`` object (which the new decoder would read as a typed
value) makes the migration refuse and change nothing; a done one does not.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb
from support import steps

from outbox_celery import Store, TableName, codec, migrate
from outbox_celery.db.migrations import applied_versions, available

from .helpers import LONG
from .test_migrations import schema_dump
from .upgrade import STATES, TABLE, claim_old_rows, old_columns, previous_schema, rows

VERSION = 10

# One payload per row of STATES (as the previous release stored them, in jsonb).
OLD_PAYLOADS: list[Any] = [
    {"b": 1, "a": [1, 2.5, None, True], "nested": {"z": "ü", "y": {}}},
    "a plain string",
    1e20,  # jsonb made it 100000000000000000000: an int, as before
    [{"__type__": "decimal"}, {"__value__": 1}],  # not an envelope: one key each
    {"__type__": "decimal", "__value__": "1.10"},  # done: never decoded again
    "1",
    None,
    {"__type__": "x", "__value__": 1, "other": 2},  # three keys: a plain object
]


def _set_payloads(conn: psycopg.Connection[Any], old: list[dict[str, Any]], payloads: list[Any]) -> None:
    t = TableName.parse(TABLE).identifier()
    for r, payload in zip(old, payloads, strict=True):
        conn.execute(sql.SQL("UPDATE {} SET payload = %s WHERE id = %s").format(t), [Jsonb(payload), r["id"]])


def test_invariant_27_migration_0010_from_the_previous_schema_with_rows_in_every_state(
    conn: psycopg.Connection[Any], table: str
) -> None:
    previous = previous_schema(conn, VERSION)
    assert STATES[4][0] == "done"  # the envelope row
    _set_payloads(conn, rows(conn), OLD_PAYLOADS)
    before = rows(conn)  # payloads as the previous release's jsonb loader gave them

    assert migrate(conn, TABLE) == [m.version for m in available() if m.version > previous]
    assert VERSION in applied_versions(conn, TABLE)
    after = rows(conn)
    decoded = [codec.decode(r.pop("payload")) for r in after]
    old_payloads = [r.pop("payload") for r in before]
    for i, (new, old) in enumerate(zip(decoded, old_payloads, strict=True)):
        if before[i]["status"] != "done":
            assert (type(new), new) == (type(old), old), before[i]
    # Later migrations add columns (0012: group_id): the old ones are as they were.
    assert old_columns(after, before) == before
    assert schema_dump(conn, TABLE) == schema_dump(conn, table)

    # The dispatcher hands the old rows over as the previous release did.
    store = Store(TABLE)
    claimed = claim_old_rows(conn, store, before)
    by_id = {r["id"]: (r, p) for r, p in zip(before, old_payloads, strict=True)}
    for outbox_id in claimed:
        version = rows(conn)[[r["id"] for r in before].index(outbox_id)]["lease_version"]
        msg = steps.start(store, conn, outbox_id, version, lease=LONG, max_attempts=12)
        assert msg is not None
        assert (type(msg.payload), msg.payload) == (type(by_id[outbox_id][1]), by_id[outbox_id][1])
    assert migrate(conn, TABLE) == []


def test_invariant_27_migration_0010_refuses_while_an_unfinished_row_holds_an_envelope(
    conn: psycopg.Connection[Any],
) -> None:
    previous_schema(conn, VERSION)
    old = rows(conn)
    pending = next(r for r in old if r["status"] == "dead")
    t = TableName.parse(TABLE).identifier()
    conn.execute(
        sql.SQL("UPDATE {} SET payload = %s WHERE id = %s").format(t),
        [Jsonb({"amount": {"__value__": "1.10", "__type__": "decimal"}}), pending["id"]],
    )
    with pytest.raises(psycopg.Error, match="migration 0010: 1 unfinished row"):
        migrate(conn, TABLE)
    assert VERSION not in applied_versions(conn, TABLE)
    kind = conn.execute(
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute"
        " WHERE attrelid = %s::regclass AND attname = 'payload'",
        [t.as_string(conn)],
    ).fetchone()
    assert kind == ("jsonb",)  # nothing changed
    # Once it is finished (here: deleted), the migration runs.
    conn.execute(sql.SQL("DELETE FROM {} WHERE id = %s").format(t), [pending["id"]])
    assert VERSION in migrate(conn, TABLE)
