"""Schema management: idempotent, versioned, and migrations replayed == schema.sql."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from psycopg import sql
from support import steps

from outbox_celery import Store, TableName, migrate, ops
from outbox_celery.db import statements as _sql
from outbox_celery.db.migrations import MigrationError, applied_versions, available, pending
from outbox_celery.testing import temporary_database

from .helpers import add, claim_ids


def _oid(conn: psycopg.Connection[Any], table: TableName) -> int:
    row = conn.execute("SELECT to_regclass(%s)::oid", [table.identifier().as_string(conn)]).fetchone()
    assert row is not None and row[0] is not None, f"{table} does not exist"
    return int(row[0])


def schema_dump(conn: psycopg.Connection[Any], table: str | TableName) -> dict[str, Any]:
    """Everything PostgreSQL knows about the table's shape, with its own name taken out.

    Columns (order, type, default, nullability, identity), constraints, indexes (as
    pg_get_indexdef renders them), storage options, the identity sequence, triggers, comments.
    """
    t = TableName.parse(table)
    oid = _oid(conn, t)
    spellings = conn.execute(
        "SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname), c.oid::regclass::text"
        " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = %s",
        [oid],
    ).fetchone()
    assert spellings is not None

    def norm(text: Any) -> Any:
        if not isinstance(text, str):
            return text
        # The table as PostgreSQL prints it (qualified or not), then its bare name inside
        # derived names (indexes, constraints); quoting differs between names, so drop it.
        for spelling in (*spellings, t.name):
            text = text.replace(spelling, "<t>")
        return text.replace('"', "")

    columns = conn.execute(
        "SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull, a.attidentity,"
        " a.attgenerated, pg_get_expr(d.adbin, d.adrelid), a.attcollation::regcollation::text,"
        " col_description(a.attrelid, a.attnum)"
        " FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum"
        " WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
        [oid],
    ).fetchall()
    constraints = conn.execute(
        "SELECT conname, contype, pg_get_constraintdef(oid), condeferrable, convalidated"
        " FROM pg_constraint WHERE conrelid = %s",
        [oid],
    ).fetchall()
    indexes = conn.execute(
        "SELECT c.relname, pg_get_indexdef(i.indexrelid), i.indisunique, i.indisprimary, c.reloptions"
        " FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = %s",
        [oid],
    ).fetchall()
    table_row = conn.execute(
        "SELECT relkind, relpersistence, reloptions, relrowsecurity, relreplident,"
        " obj_description(oid, 'pg_class') FROM pg_class WHERE oid = %s",
        [oid],
    ).fetchone()
    sequence = conn.execute(
        "SELECT s.seqtypid::regtype::text, s.seqstart, s.seqincrement, s.seqmax, s.seqmin, s.seqcache,"
        " s.seqcycle FROM pg_sequence s"
        " WHERE s.seqrelid IN (SELECT pg_get_serial_sequence(%s, a.attname)::regclass"
        "                      FROM pg_attribute a WHERE a.attrelid = %s AND a.attname = 'id')",
        [t.identifier().as_string(conn), oid],
    ).fetchall()
    triggers = conn.execute(
        "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger WHERE tgrelid = %s AND NOT tgisinternal",
        [oid],
    ).fetchall()
    return {
        "columns": [tuple(norm(v) for v in r) for r in columns],
        "constraints": sorted(tuple(norm(v) for v in r) for r in constraints),
        "indexes": sorted(tuple(norm(v) for v in r) for r in indexes),
        "table": table_row,
        "sequence": sequence,
        "triggers": sorted(tuple(norm(v) for v in r) for r in triggers),
    }


def test_every_shipped_migration_is_numbered_in_sequence() -> None:
    versions = [m.version for m in available()]
    assert versions == list(range(1, len(versions) + 1))
    assert all(m.text.strip() for m in available())


def test_migrate_twice_changes_nothing(conn: psycopg.Connection[Any], table: str) -> None:
    # The `conn` fixture migrated once already.
    everything = [m.version for m in available()]
    assert applied_versions(conn, table) == everything
    assert pending(conn, table) == []
    before = schema_dump(conn, table)
    ledger = conn.execute("SELECT * FROM outbox_celery_migrations ORDER BY version").fetchall()
    assert migrate(conn, table) == []
    assert migrate(conn, table, fresh_schema=False) == []
    assert schema_dump(conn, table) == before
    assert conn.execute("SELECT * FROM outbox_celery_migrations ORDER BY version").fetchall() == ledger


def test_a_fresh_install_records_every_version(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        assert applied_versions(c, "outbox") == []
        assert [m.version for m in pending(c, "outbox")] == [m.version for m in available()]
        assert migrate(c, "outbox") == [m.version for m in available()]
        names = c.execute("SELECT version, name FROM outbox_celery_migrations ORDER BY version").fetchall()
        assert names == [(m.version, m.name) for m in available()]


@pytest.mark.parametrize("table", ["events.outbox", "Out Box", "My Schema.Out Box", "select"])
def test_odd_and_schema_qualified_names_migrate_and_work(conn: psycopg.Connection[Any], table: str) -> None:
    t = TableName.parse(table)
    assert applied_versions(conn, table) == [m.version for m in available()]
    indexes = {
        r[0]
        for r in conn.execute(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE i.indrelid = to_regclass(%s)",
            [t.identifier().as_string(conn)],
        ).fetchall()
    }
    assert indexes == {t.name + s for s in ("_pkey", *_sql.INDEX_SUFFIXES.values())}
    if t.schema:
        # The ledger lives next to the table, and nothing leaked into public.
        assert conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL",
            [sql.Identifier(t.schema, "outbox_celery_migrations").as_string(conn)],
        ).fetchone() == (True,)
        assert conn.execute("SELECT to_regclass('public.outbox_celery_migrations')").fetchone() == (None,)
    store = Store(table)
    ids = add(conn, 3, table=table)
    assert claim_ids(store, conn) == ids
    assert migrate(conn, table) == []


def test_tables_of_the_same_name_in_different_schemas_are_migrated_separately(
    conn: psycopg.Connection[Any],
) -> None:
    everything = [m.version for m in available()]
    assert migrate(conn, "events.outbox") == everything
    assert migrate(conn, "archive.outbox") == everything
    assert migrate(conn, "events.other") == everything
    assert migrate(conn, "Outbox") == everything  # quoted: not the same as outbox
    [i] = add(conn, table="events.outbox")
    assert claim_ids(Store("outbox"), conn) == []
    assert claim_ids(Store("archive.outbox"), conn) == []
    assert claim_ids(Store("events.outbox"), conn) == [i]


def test_a_pre_existing_unrecorded_table_is_refused(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE outbox (id bigint PRIMARY KEY, body text)")
        with pytest.raises(MigrationError, match="no recorded outbox-celery migrations"):
            migrate(c, "outbox")
        # Nothing was done: not even the ledger stayed behind, and the table is untouched.
        assert c.execute("SELECT to_regclass('outbox_celery_migrations')").fetchone() == (None,)
        columns = c.execute(
            "SELECT attname FROM pg_attribute"
            " WHERE attrelid = 'outbox'::regclass AND attnum > 0 ORDER BY attnum"
        ).fetchall()
        assert columns == [("id",), ("body",)]


def test_concurrent_migrators_apply_each_version_once(dsn: str) -> None:
    results: list[list[int]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(3)

    def run() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as c:
                barrier.wait(10)
                results.append(migrate(c, "events.outbox"))
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert sorted(results) == [[], [], [m.version for m in available()]]


# -- replaying every migration gives exactly schema.sql ------------------------------------


def _replay_up_to(conn: psycopg.Connection[Any], table: str, version: int) -> None:
    """Build ``table`` as an old release did: migrations up to ``version``, recorded."""
    t = TableName.parse(table)
    migrate(conn, f"{t.schema}.scratch" if t.schema else "scratch")  # creates the ledger
    ledger = (
        sql.Identifier(t.schema, "outbox_celery_migrations")
        if t.schema
        else sql.Identifier("outbox_celery_migrations")
    )
    with conn.transaction():
        for m in available():
            if m.version <= version:
                conn.execute(_sql.compose(m.text, t))
                conn.execute(
                    sql.SQL("INSERT INTO {} (table_name, version, name) VALUES (%s, %s, %s)").format(ledger),
                    [t.name, m.version, m.name],
                )


PAIRS = [
    # (fresh install, replayed), in two different databases
    ("outbox", "outbox", True),
    ("events.Fresh Box", "other.replayed_box", True),
    # ... and side by side in one database
    ("outbox", "Replayed Box", False),
]


@pytest.mark.parametrize(("fresh", "replayed", "two_databases"), PAIRS)
def test_applying_every_migration_in_order_yields_exactly_the_fresh_schema(
    dsn: str, server_dsn: str, fresh: str, replayed: str, two_databases: bool
) -> None:
    # The outbox table and the ones beside it holding its identity (migration 0006) and
    # its flow-control state (migration 0007).
    with psycopg.connect(dsn, autocommit=True) as c1:
        assert migrate(c1, fresh) == [m.version for m in available()]
        expected = schema_dump(c1, fresh)
        expected_instance = schema_dump(c1, fresh + "_instance")
        expected_flow = schema_dump(c1, fresh + "_flow")
        expected_keys = schema_dump(c1, fresh + "_flow_key")
        if two_databases:
            with temporary_database(server_dsn) as other, psycopg.connect(other, autocommit=True) as c2:
                assert migrate(c2, replayed, fresh_schema=False) == [m.version for m in available()]
                got = schema_dump(c2, replayed)
                got_instance = schema_dump(c2, replayed + "_instance")
                got_flow = schema_dump(c2, replayed + "_flow")
                got_keys = schema_dump(c2, replayed + "_flow_key")
        else:
            assert migrate(c1, replayed, fresh_schema=False) == [m.version for m in available()]
            got = schema_dump(c1, replayed)
            got_instance = schema_dump(c1, replayed + "_instance")
            got_flow = schema_dump(c1, replayed + "_flow")
            got_keys = schema_dump(c1, replayed + "_flow_key")
    assert got == expected
    assert got_instance == expected_instance
    assert got_flow == expected_flow
    # ... and its pauses and holds per limit key (migration 0008).
    assert got_keys == expected_keys
    assert [c[0] for c in expected_keys["columns"]][:2] == ["event_type", "limit_key"]
    assert [c[0] for c in expected_flow["columns"]][:3] == ["event_type", "paused", "paused_until"]
    assert [c[0] for c in expected_instance["columns"]] == ["singleton", "instance", "created_at"]
    assert len(expected["indexes"]) == 1 + len(_sql.INDEX_SUFFIXES)
    assert expected["table"][2], "autovacuum settings missing"


@pytest.mark.parametrize("version", [m.version for m in available()][:-1] or [0])
def test_upgrading_from_an_older_release_yields_exactly_the_fresh_schema(
    conn: psycopg.Connection[Any], table: str, version: int
) -> None:
    _replay_up_to(conn, "events.upgraded", version)
    assert applied_versions(conn, "events.upgraded") == list(range(1, version + 1))
    assert migrate(conn, "events.upgraded") == [m.version for m in available() if m.version > version]
    assert schema_dump(conn, "events.upgraded") == schema_dump(conn, table)


MUTATIONS: list[tuple[str, str]] = [
    ("drop index", "DROP INDEX {schema}.{pending_idx}"),
    ("other default", "ALTER TABLE {table} ALTER COLUMN attempts SET DEFAULT 1"),
    ("nullable", "ALTER TABLE {table} ALTER COLUMN ordering_key SET NOT NULL"),
    ("other type", "ALTER TABLE {table} ALTER COLUMN lease_owner TYPE varchar(100)"),
    ("storage option", "ALTER TABLE {table} RESET (autovacuum_vacuum_threshold)"),
    ("constraint", "ALTER TABLE {table} DROP CONSTRAINT {check}"),
    (
        "index predicate",
        "DROP INDEX {schema}.{pending_idx}; CREATE INDEX {pending_idx} ON {table} (available_at, id)",
    ),
    ("extra column", "ALTER TABLE {table} ADD COLUMN extra int"),
]


@pytest.mark.parametrize(("what", "ddl"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_the_schema_comparison_notices_a_difference(
    conn: psycopg.Connection[Any], table: str, what: str, ddl: str
) -> None:
    # Guards the guard: if schema_dump missed such a change, the test above would prove nothing.
    migrate(conn, "events.twin", fresh_schema=False)
    assert schema_dump(conn, "events.twin") == schema_dump(conn, table)
    twin = TableName.parse("events.twin")
    conn.execute(
        sql.SQL(ddl).format(
            table=twin.identifier(),
            schema=sql.Identifier("events"),
            pending_idx=twin.index_name("_pending_idx"),
            check=sql.Identifier("twin_attempts_check"),
        )
    )
    assert schema_dump(conn, "events.twin") != schema_dump(conn, table), what


def test_migration_3_started_version_from_the_previous_schema_with_rows_in_every_state(
    conn: psycopg.Connection[Any],
) -> None:
    # Invariants 10, 16: after the upgrade a processing claim with no attempt yet counts as lost
    # (its task never started), any other row as started: an expired lease is re-claimed, and a
    # certainly-lost claim is given back unspent (a first loss is claimed again at once; repeats
    # wait out a delay).
    _replay_up_to(conn, "events.upgraded", 2)
    t = TableName.parse("events.upgraded")
    insert = sql.SQL(
        "INSERT INTO {} (event_type, aggregate_type, aggregate_id, payload, ordering_key, status,"
        " attempts, lease_version, lease_until, done_at, last_error)"
        " VALUES ('e', 'a', %s, '{{}}', %s, %s, %s, %s, now() + make_interval(secs => %s), %s, %s)"
        " RETURNING id"
    ).format(t.identifier())
    states = {
        # name: (ordering_key, status, attempts, lease_version, lease seconds from now, done_at, error)
        "pending": (None, "pending", 1, 2, None, None, "HTTP 503"),
        "pending_ordered": ("k1", "pending", 0, 0, None, None, None),
        "live_unstarted": (None, "processing", 0, 1, 60, None, None),
        "live_started": ("k2", "processing", 2, 3, 60, None, None),
        "expired_unstarted": (None, "processing", 0, 4, -60, None, None),
        "expired_started": (None, "processing", 1, 2, -60, None, None),
        "done": (None, "done", 1, 1, None, "2026-01-01T00:00:00Z", None),
        "dead": ("k3", "dead", 3, 3, None, None, "HTTP 400"),
    }
    ids: dict[str, int] = {}
    for name, (key, status, attempts, version, lease, done_at, error) in states.items():
        row = conn.execute(insert, [name, key, status, attempts, version, lease, done_at, error]).fetchone()
        assert row is not None
        ids[name] = int(row[0])
    assert migrate(conn, "events.upgraded") == [m.version for m in available() if m.version > 2]

    def started_versions() -> dict[str, tuple[str, int, int]]:
        got = conn.execute(
            sql.SQL("SELECT aggregate_id, status, lease_version, started_version FROM {}").format(
                t.identifier()
            )
        ).fetchall()
        return {r[0]: (r[1], int(r[2]), int(r[3])) for r in got}

    assert started_versions() == {
        "pending": ("pending", 2, 2),
        "pending_ordered": ("pending", 0, 0),
        "live_unstarted": ("processing", 1, 0),
        "live_started": ("processing", 3, 3),
        "expired_unstarted": ("processing", 4, 3),
        "expired_started": ("processing", 2, 2),
        "done": ("done", 1, 0),
        "dead": ("dead", 3, 3),
    }
    result = steps.claim(Store("events.upgraded"), conn, limit=10, lease=60.0, owner="w", max_attempts=5)
    assert sorted(c.id for c in result.claimed) == sorted(
        [ids["expired_started"], ids["expired_unstarted"], ids["pending"], ids["pending_ordered"]]
    )
    assert result.lost == 1
    after = started_versions()
    assert after["expired_unstarted"] == ("processing", 5, 3)
    assert after["live_unstarted"] == ("processing", 1, 0)
    assert after["done"][0] == "done" and after["dead"][0] == "dead"


# -- 0004: explicit ordered heads, from tables holding rows in every state ----------------------

ROWS_BEFORE_0004 = """
INSERT INTO {t} (event_type, aggregate_type, aggregate_id, payload, ordering_key, status,
                 attempts, lease_version, lease_until, last_error, done_at)
VALUES
    -- key A: a done message, then a dead head with two messages waiting behind it
    ('e', 'a', '1', '{{}}', 'A', 'done', 1, 1, NULL, NULL, now()),
    ('e', 'a', '2', '{{}}', 'A', 'dead', 1, 1, NULL, 'HTTP 400', NULL),
    ('e', 'a', '3', '{{}}', 'A', 'pending', 0, 0, NULL, NULL, NULL),
    ('e', 'a', '4', '{{}}', 'A', 'pending', 0, 0, NULL, NULL, NULL),
    -- key B: a head processing under a live lease, one message waiting
    ('e', 'b', '5', '{{}}', 'B', 'processing', 1, 1, now() + interval '1 hour', NULL, NULL),
    ('e', 'b', '6', '{{}}', 'B', 'pending', 0, 0, NULL, NULL, NULL),
    -- key C: a head whose lease expired with attempts left, one message waiting
    ('e', 'c', '7', '{{}}', 'C', 'processing', 1, 3, now() - interval '1 minute', NULL, NULL),
    ('e', 'c', '8', '{{}}', 'C', 'pending', 0, 0, NULL, NULL, NULL),
    -- key D: three pending messages, none claimed yet
    ('e', 'd', '9', '{{}}', 'D', 'pending', 0, 0, NULL, NULL, NULL),
    ('e', 'd', '10', '{{}}', 'D', 'pending', 0, 0, NULL, NULL, NULL),
    ('e', 'd', '11', '{{}}', 'D', 'pending', 0, 0, NULL, NULL, NULL),
    -- key E: finished
    ('e', 'e', '12', '{{}}', 'E', 'done', 1, 1, NULL, NULL, now()),
    -- unordered rows in every state
    ('e', 'u', '13', '{{}}', NULL, 'pending', 0, 0, NULL, NULL, NULL),
    ('e', 'u', '14', '{{}}', NULL, 'processing', 1, 1, now() + interval '1 hour', NULL, NULL),
    ('e', 'u', '15', '{{}}', NULL, 'processing', 1, 1, now() - interval '1 minute', NULL, NULL),
    ('e', 'u', '16', '{{}}', NULL, 'done', 1, 1, NULL, NULL, now()),
    ('e', 'u', '17', '{{}}', NULL, 'dead', 1, 1, NULL, 'HTTP 400', NULL);
"""


def test_0004_flags_the_head_of_every_key_and_keeps_every_ordering_rule(
    conn: psycopg.Connection[Any], table: str
) -> None:
    upgraded = TableName.parse("events.upgraded")
    _replay_up_to(conn, str(upgraded), 2)
    conn.execute(sql.SQL(ROWS_BEFORE_0004).format(t=upgraded.identifier()))
    assert migrate(conn, upgraded) == [m.version for m in available() if m.version > 2]
    assert schema_dump(conn, upgraded) == schema_dump(conn, table)
    heads = conn.execute(
        sql.SQL("SELECT id FROM {} WHERE head AND status <> 'done' ORDER BY id").format(upgraded.identifier())
    ).fetchall()
    assert [r[0] for r in heads] == [2, 5, 7, 9]
    # stats reads the flags: D's head and one unordered row are ready; A is blocked, 2 waiting.
    s = ops.stats(conn, upgraded)
    assert (s.ready, s.blocked_keys, s.blocked_messages) == (2, 1, 2)
    store = Store(upgraded)
    # The expired head comes back first with a new token and keeps its place; D's head and the
    # unordered rows are claimable; A (dead head) and B (live lease) stay blocked (invariant 9).
    claims = {
        c.id: c for c in steps.claim(store, conn, limit=20, lease=60, owner="w", max_attempts=5).claimed
    }
    assert sorted(claims) == [7, 9, 13, 15]
    assert claims[7].lease_version == 4
    assert claim_ids(store, conn) == []
    for i in (7, 9):
        assert steps.done(store, conn, i, claims[i].lease_version).applied
    assert sorted(claim_ids(store, conn)) == [8, 10]
    assert ops.skip(conn, upgraded, [2], reason="obsolete") == [2]
    assert claim_ids(store, conn) == [3]
    # New messages of an upgraded key queue behind its head; of a finished key, lead it.
    [e2] = add(conn, table=str(upgraded), key="E")
    [b3] = add(conn, table=str(upgraded), key="B")
    assert claim_ids(store, conn) == [e2]
    assert steps.done(store, conn, 5, 1).applied
    assert claim_ids(store, conn) == [6]
    assert b3 > 6
