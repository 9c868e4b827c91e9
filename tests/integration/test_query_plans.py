"""EXPLAIN regression on the hot queries: claim cost must stay flat as history grows.

A table with 50k finished rows, an ordered backlog (20k messages over 5k keys) and a little
unordered and expired work must be claimed, started and finalized through indexes: a
sequential scan of the outbox table in any of these plans is a regression.

Two plans are checked per query: the custom plan (parameters known), and the plan a prepared
statement settles on, since psycopg prepares a query after a few executions and PostgreSQL then
weighs a generic plan against the custom ones. That second plan is taken from the plan cache
after six executions rather than forced with ``plan_cache_mode = force_generic_plan``: a forced
generic claim guesses its LIMIT at 10% of the due rows and may hash-join through a sequential
scan, a plan PostgreSQL only adopts when its estimated cost is below the custom plans' (a small
table), and which is not what runs here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_celery import Store, migrate
from outbox_celery.db.completer import START_KEEP
from outbox_celery.testing import temporary_database

TABLE = "events.Out Box"

LOAD = """
INSERT INTO {table} (event_type, aggregate_type, aggregate_id, payload, status, done_at, attempts,
                     lease_version, ordering_key, created_at, available_at)
SELECT 'e', 'a', g::text, '{{"n": 1}}', 'done', now() - make_interval(secs => g), 1, 1,
       CASE WHEN g % 4 = 0 THEN 'key' || (g % 500) END, now() - interval '2 days',
       now() - interval '2 days'
FROM generate_series(1, 50000) AS g;
INSERT INTO {table} (event_type, aggregate_type, aggregate_id, payload)
SELECT 'e', 'a', g::text, '{{}}' FROM generate_series(1, 200) AS g;
INSERT INTO {table} (event_type, aggregate_type, aggregate_id, payload, ordering_key)
SELECT 'e', 'a', g::text, '{{}}', 'key' || (g % 5000) FROM generate_series(1, 20000) AS g;
INSERT INTO {table} (event_type, aggregate_type, aggregate_id, payload, status, lease_until,
                     lease_version, attempts)
SELECT 'e', 'a', g::text, '{{}}', 'processing', now() - interval '1 minute', 1, g % 3
FROM generate_series(1, 30) AS g;
INSERT INTO {table} (event_type, aggregate_type, aggregate_id, payload, status, last_error)
SELECT 'e', 'a', g::text, '{{}}', 'dead', 'x' FROM generate_series(1, 30) AS g;
UPDATE {table} AS o SET head = true
FROM (SELECT DISTINCT ON (ordering_key) id FROM {table}
      WHERE ordering_key IS NOT NULL AND status <> 'done' ORDER BY ordering_key, id) AS h
WHERE o.id = h.id;
"""

# A live row for the by-id queries: one of the 200 pending ones after the 50k done rows.
LIVE_ID = 50_100
PARAMS: dict[str, Any] = {
    "lease": 60.0,
    "keep": START_KEEP,
    "owner": "worker-1",
    "starter": "worker-1:1:abc",
    "max_attempts": 12,
    "event_types": None,
    "excluded": [],
    "limit": 200,
    "id": LIVE_ID,
    "lease_version": 1,
    "delay": 1.5,
    "error": "HTTP 503",
    "reason": "not yet",
    "max_age": 604800.0,
    "seconds": 30.0,
    "ids": [LIVE_ID, LIVE_ID + 1],
    "lease_versions": [1, 1],
    "outcomes": ["done", "retry"],
    "delays": [0.0, 1.5],
    "errors": ["", "HTTP 503"],
    "outcome": "done",
    "keys_locked": False,
    "keys": ["key7"],
    "inline_share": 1 << 20,
    "commit_mode": None,
    "window": 60.0,
    "cap": 1000,
    "unroutable_delay": 60.0,
    "table": '"events"."Out Box"',
    "event_type": "e",
    "aggregate_type": "a",
    "aggregate_id": "1",
    "payload": "{}",
    "ordering_key": "key7",
    "dedup_key": None,
    "trace_context": None,
    "notify": False,
    "pending_since": None,
    "heads_since": None,
    "expired_since": None,
    "within": 1.0,
    "probe": True,
    "claim_lock": False,
    "types": ["thing.happened"],
    "limits": [200],
    "since": [None],
    "limited": ["thing.happened"],
    # Limits per key (DESIGN invariant 24).
    "limit_key": None,
    "keyed": ["thing.happened"],
    "n": 200,
    "key_cap": 2,
    "key_rate": 10.0,
    "key_burst": 2.0,
    "held": [],
    "after": None,
    "max_keys": 400,
}

HOT = [
    # A claim's first statement probes the expired and heads ranges (claim_probes).
    "claim_settings",
    "claim_settings_flow",
    "first_expired",
    "claim_pending",
    "claim_expired",
    "claim_heads",
    "reap",
    "release_expired",
    "start",
    "start:one",
    "resume",
    "start_exhausted",
    "payloads",
    # The completer's one finalize, of many rows and of one (its one-row form, _sql.one_row).
    "finish",
    "finish:one",
    "lock_key_of",
    "settle_heads",
    "insert",
    "extend_lease",
    "extend_lease:one",
    "count_in_flight",
    "next_due",
    # Flow control: the limited types' own claim statements and their live-lease count.
    "claim_expired_limited",
    "claim_heads_limited",
    "claim_pending_limited",
    "flow_live",
    # Batch handlers' max_wait: a batch's worth of a type's due rows.
    "fill_due",
    # Limits per key (DESIGN invariant 24): the keys' walk, their live leases and rows.
    "claim_keyed",
    "release_keyed_expired",
]


@pytest.fixture(scope="module")
def history(server_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A database whose outbox holds a long history and a backlog, analyzed."""
    with (
        temporary_database(server_dsn, prefix="outbox_plans") as db,
        psycopg.connect(db, autocommit=True) as c,
    ):
        c.prepare_threshold = None  # our own PREPAREs only
        migrate(c, TABLE)
        store = Store(TABLE)
        c.execute(sql.SQL(LOAD).format(table=store.table.identifier()))
        c.execute(sql.SQL("ANALYZE {}").format(store.table.identifier()))
        yield c


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _scans(explain: Any) -> list[tuple[str, str | None]]:
    """(node type, index name) of every node that reads the outbox table."""
    [top] = explain
    name = Store(TABLE).table.name
    return [
        (n["Node Type"], n.get("Index Name"))
        for n in _nodes(top["Plan"])
        if n.get("Relation Name") == name and n["Node Type"] != "ModifyTable"
    ]


def _custom_plan(conn: psycopg.Connection[Any], query: sql.Composed, params: dict[str, Any] = PARAMS) -> Any:
    row = conn.execute(sql.SQL("EXPLAIN (FORMAT JSON) ") + query, params).fetchone()
    assert row is not None
    return row[0]


def _prepared_plan(
    conn: psycopg.Connection[Any], name: str, query: sql.Composed, params: dict[str, Any] = PARAMS
) -> Any:
    # PREPARE needs $n placeholders; the named parameters become positional in first-use order.
    order: list[str] = []

    def positional(m: re.Match[str]) -> str:
        if m.group(1) not in order:
            order.append(m.group(1))
        return f"${order.index(m.group(1)) + 1}"

    text = re.sub(r"%\((\w+)\)s", positional, query.as_string(conn))
    statement = sql.Identifier(f"plan_{name.replace(':', '_')}")
    conn.execute(sql.SQL("PREPARE {} AS ").format(statement) + sql.SQL(text))  # type: ignore[arg-type]
    explain = sql.SQL("EXPLAIN (FORMAT JSON) EXECUTE {}").format(statement)
    if order:
        explain += sql.SQL("({})").format(sql.SQL(", ").join(sql.Literal(params[n]) for n in order))
    try:
        # Five custom plans, then PostgreSQL prices the generic plan and keeps the cheaper.
        for _ in range(6):
            conn.execute(explain)
        row = conn.execute(explain).fetchone()
    finally:
        conn.execute(sql.SQL("DEALLOCATE {}").format(statement))
    assert row is not None
    return row[0]


@pytest.mark.parametrize("plan", ["custom", "prepared"])
@pytest.mark.parametrize("name", HOT)
def test_hot_queries_never_scan_the_whole_outbox_table(
    history: psycopg.Connection[Any], name: str, plan: str
) -> None:
    store = Store(TABLE)
    query = store._one[name.removesuffix(":one")] if name.endswith(":one") else store._q[name]
    explain = _custom_plan(history, query) if plan == "custom" else _prepared_plan(history, name, query)
    scans = _scans(explain)
    assert scans, f"{name}: the plan does not read the outbox table at all?"
    assert all(node != "Seq Scan" for node, _ in scans), f"{name} ({plan} plan): {scans}"
    assert any(index is not None for _, index in scans), f"{name} ({plan} plan): {scans}"


def test_invariant_17_claim_heads_reads_only_the_pending_heads_never_every_key(
    history: psycopg.Connection[Any],
) -> None:
    # 5,000 keys hold 20,000 unfinished ordered messages: the claim reads the pending heads'
    # partial index in due order and stops at its LIMIT, whatever the number of keys.
    store = Store(TABLE)
    scans = _scans(_custom_plan(history, store._q["claim_heads"]))
    heads_idx = store.table.name + "_heads_idx"
    assert [index for _, index in scans] == [heads_idx, store.table.name + "_pkey"], scans
    with history.transaction(force_rollback=True):
        row = history.execute(
            sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) ") + store._q["claim_heads"], {**PARAMS, "limit": 10}
        ).fetchone()
    assert row is not None
    [top] = row[0]
    read = [n for n in _nodes(top["Plan"]) if n.get("Index Name") == heads_idx]
    assert read and all(n["Actual Rows"] <= 10 for n in read), read


def test_an_ordered_insert_finds_its_keys_unfinished_messages_through_the_ordered_index(
    history: psycopg.Connection[Any],
) -> None:
    store = Store(TABLE)
    scans = _scans(_custom_plan(history, store._q["insert"]))
    # One probe for the event's row, one for its other subscriptions' rows (invariant 28).
    assert [index for _, index in scans] == [store.table.name + "_ordered_idx"] * 2, scans
    scans = _scans(_custom_plan(history, store._q["settle_heads"]))
    assert store.table.name + "_ordered_idx" in [index for _, index in scans], scans


# Statistics taken while no lease was live, then thousands of live leases: what a table analyzed
# (or vacuumed) between bursts looks like to the planner when the next burst is claimed.
LIVE_LEASES = """
INSERT INTO {table} (event_type, aggregate_type, aggregate_id, payload)
SELECT 'e', 'a', g::text, '{{}}' FROM generate_series(1, 4000) AS g;
"""
CLAIM_THEM = """
UPDATE {table} SET status = 'processing', lease_until = now() + interval '1 minute',
                   lease_version = 1, lease_owner = 'w'
"""

# The statements that find their rows by id, fenced on status and lease_version.
BY_ID = ["start", "resume", "start_exhausted", "finish", "extend_lease"]


@pytest.fixture(scope="module")
def live_leases(server_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """4,000 live leases in a table whose statistics say none is live."""
    with (
        temporary_database(server_dsn, prefix="outbox_plans_live") as db,
        psycopg.connect(db, autocommit=True) as c,
    ):
        c.prepare_threshold = None
        migrate(c, TABLE)
        store = Store(TABLE)
        c.execute(sql.SQL(LIVE_LEASES).format(table=store.table.identifier()))
        c.execute(sql.SQL("VACUUM ANALYZE {}").format(store.table.identifier()))
        c.execute(sql.SQL(CLAIM_THEM).format(table=store.table.identifier()))
        yield c


@pytest.mark.parametrize("plan", ["custom", "prepared"])
@pytest.mark.parametrize("name", BY_ID + [f"{n}:one" for n in BY_ID])
def test_fenced_statements_find_their_rows_by_the_primary_key_whatever_the_statistics_say(
    live_leases: psycopg.Connection[Any], name: str, plan: str
) -> None:
    # Priced from statistics that say no lease is live, the live leases' partial index looks
    # empty: a statement free to read it instead of the key would step over all 4,000 leases
    # to find its one row (the fenced status test keeps it to the key).
    store = Store(TABLE)
    query = store._one[name.removesuffix(":one")] if name.endswith(":one") else store._q[name]
    params = {**PARAMS, "id": 2000, "ids": [2000, 2001]}
    if plan == "custom":
        explain = _custom_plan(live_leases, query, params)
    else:
        explain = _prepared_plan(live_leases, name, query, params)
    scans = _scans(explain)
    assert scans and all(index == store.table.name + "_pkey" for _, index in scans), f"{name}: {scans}"
