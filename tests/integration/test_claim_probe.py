"""An idle sweep's one statement (DESIGN invariant 36): ``Store.claim_probe`` says no only where
a claim finds nothing to do.

Each case puts the table in one state (rows written as the library writes them, then moved by
SQL to the state under test), asks the probe, then runs a real claim on the same rows: whenever
the claim did something (claimed, reaped, gave back), the probe must have said yes. The probe may
say yes where the claim then finds nothing (a type no handler here takes), never the reverse.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_celery import Store, enqueue
from outbox_celery.claim import executor

ORDER = {"event_type": "order.created", "aggregate_type": "order", "aggregate_id": "42", "payload": {}}

# name -> (how the rows are written, the UPDATE that moves them, whether a claim acts on them)
CASES: dict[str, tuple[dict[str, Any], str | None, bool]] = {
    "empty": ({}, None, False),
    "pending, due": (ORDER, None, True),
    "pending, delayed 30 s": ({**ORDER, "delay": 30}, None, False),
    "ordered head, due": ({**ORDER, "ordered": True}, None, True),
    "ordered head, backed off 30 s": (
        {**ORDER, "ordered": True},
        "UPDATE {t} SET available_at = now() + interval '30 seconds'",
        False,
    ),
    "processing, live lease": (
        ORDER,
        "UPDATE {t} SET status = 'processing', lease_until = now() + interval '1 minute',"
        " lease_version = 1, started_version = 1, attempts = 1",
        False,
    ),
    "processing, lease ran out, started (its worker died)": (
        ORDER,
        "UPDATE {t} SET status = 'processing', lease_until = now() - interval '1 second',"
        " lease_version = 1, started_version = 1, attempts = 1",
        True,
    ),
    "processing, lease ran out, never started (a lost task)": (
        ORDER,
        "UPDATE {t} SET status = 'processing', lease_until = now() - interval '1 second',"
        " lease_version = 1, started_version = 0",
        True,
    ),
    "processing, lease ran out, attempts exhausted": (
        ORDER,
        "UPDATE {t} SET status = 'processing', lease_until = now() - interval '1 second',"
        " lease_version = 3, started_version = 3, attempts = 3",
        True,
    ),
    "processing, lease ran out, a type no handler takes": (
        {**ORDER, "event_type": "not.mine"},
        "UPDATE {t} SET status = 'processing', lease_until = now() - interval '2 minutes',"
        " lease_version = 1, started_version = 1, attempts = 1",
        True,
    ),
    "done": (ORDER, "UPDATE {t} SET status = 'done', done_at = now()", False),
    "dead": (ORDER, "UPDATE {t} SET status = 'dead', last_error = 'x'", False),
}


def _claim(store: Store, conn: psycopg.Connection[Any]) -> bool:
    """Run a real claim (no scan marks: a full pass) and say whether it did anything."""
    result = executor.claim(
        store,
        conn,
        limit=10,
        lease=60.0,
        owner="probe-test",
        max_attempts=3,
        event_types=["order.created"],
        unroutable_delay=60.0,
    )
    return bool(result.claimed or result.reaped or result.lost or result.unroutable)


@pytest.mark.parametrize("case", list(CASES))
def test_invariant_36_the_probe_says_no_only_where_a_claim_finds_nothing(
    conn: psycopg.Connection[Any], table: str, case: str
) -> None:
    written, moved, acts = CASES[case]
    store = Store(table)
    if written:
        with conn.transaction():
            enqueue(conn, table=table, **written)
    if moved:
        conn.execute(sql.SQL(moved).format(t=store.table.identifier()))
    due, _ = store.claim_probe(conn, ["order.created"], within=0.0)
    assert _claim(store, conn) == acts, f"{case}: the claim {'did nothing' if acts else 'acted'}"
    assert due == acts, f"{case}: the probe said {'yes' if due else 'no'}"


def test_invariant_36_a_yes_may_be_false_never_a_no(conn: psycopg.Connection[Any], table: str) -> None:
    # A due row of a type no handler here takes: the claim leaves it (counted unroutable when
    # leased), the probe says yes, and the sweep's claim finds nothing, as every sweep did before.
    store = Store(table)
    with conn.transaction():
        enqueue(conn, table=table, **{**ORDER, "event_type": "not.mine"})
    assert store.claim_probe(conn, ["order.created"], within=0.0)[0]
    assert not _claim(store, conn)


def test_invariant_36_the_probe_also_says_when_something_comes_due(
    conn: psycopg.Connection[Any], table: str
) -> None:
    store = Store(table)
    with conn.transaction():
        enqueue(conn, table=table, delay=20, **ORDER)
        enqueue(conn, table=table, delay=5, **{**ORDER, "event_type": "not.mine"})
    due, seconds = store.claim_probe(conn, ["order.created"], within=60.0)
    assert not due and seconds is not None and 15 < seconds <= 20
    assert store.claim_probe(conn, ["order.created"], within=10.0) == (False, None)
    # next_due is the same statement without the question.
    assert store.next_due(conn, ["order.created"], within=60.0) == pytest.approx(seconds, abs=0.5)
