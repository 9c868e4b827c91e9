"""Every failed attempt is recorded (DESIGN invariant 32): ``errors`` gains one entry per failed
attempt (attempt, the database's now(), the error cut to 1,000 characters), the last 20, from
the fenced finish and from every statement that finds a started claim's lease run out; outcomes
that are no failed attempt (done, defer, RateLimited, postpone, release, hand-back, a claim that
never started) add nothing, and an operator's requeue keeps the history.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import psycopg
import pytest
from psycopg import sql
from support import steps

from outbox_celery import Claimed, Message, Outbox, PermanentError, RetryableError, Store, ops
from outbox_celery.db.completer import Finish, Lease, Step

from .helpers import LONG, PAST_SHORT, SHORT, add, fetch

LEASE_LOST = "lease expired without a result (worker lost or timed out)"


def _due_now(conn: psycopg.Connection[Any], store: Store) -> None:
    """Every waiting row due at once (a backoff's wait skipped)."""
    conn.execute(sql.SQL("UPDATE {} SET available_at = now()").format(store.table.identifier()))


def _started(
    conn: psycopg.Connection[Any], store: Store, outbox_id: int, *, max_attempts: int = 5
) -> Claimed:
    """Claim ``outbox_id`` (the only due row) and start it."""
    [c] = steps.claim(store, conn, limit=1, lease=LONG, owner="w", max_attempts=max_attempts).claimed
    assert c.id == outbox_id
    assert steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=max_attempts) is not None
    return c


def _entries(conn: psycopg.Connection[Any], table: str, outbox_id: int) -> list[tuple[int, str]]:
    """(attempt, error) of each entry of the row's errors, oldest first; checks each ``at``."""
    row = fetch(conn, table, outbox_id)
    now = conn.execute("SELECT now()").fetchone()
    assert now is not None
    for e in row["errors"] or []:
        assert datetime.fromisoformat(e["at"]) <= now[0]
    return [(e["attempt"], e["error"]) for e in row["errors"] or []]


def test_invariant_32_a_handler_failing_three_times_leaves_three_entries(
    conn: psycopg.Connection[Any], table: str, migrated_dsn: str
) -> None:
    from celery import Celery

    store = Store(table)
    outbox = Outbox(Celery("errors"), dsn=migrated_dsn, table=table, store=store, retry=lambda a, e: 30.0)

    @outbox.handler("thing.happened")
    def flaky(message: Message) -> None:
        if message.attempts == 1:
            raise ValueError("no such customer")  # a failed attempt (invariant 31)
        if message.attempts == 2:
            raise RetryableError("HTTP 503")
        raise PermanentError("HTTP 410 gone")

    [i] = add(conn, table=table)
    try:
        for attempt in (1, 2, 3):
            [c] = steps.claim(store, conn, limit=1, lease=LONG, owner="w", max_attempts=5).claimed
            if attempt == 1:
                with pytest.raises(ValueError, match="no such customer"):
                    outbox.deliver(i, c.lease_version)
            else:
                outbox.deliver(i, c.lease_version)
            _due_now(conn, store)
    finally:
        outbox.close()
    entries = _entries(conn, table, i)
    assert [a for a, _ in entries] == [1, 2, 3]
    assert entries[0][1].startswith("ValueError: no such customer\nTraceback")
    assert "HTTP 503" in entries[1][1] and "HTTP 410 gone" in entries[2][1]
    row = fetch(conn, table, i)
    assert (row["status"], row["attempts"]) == ("dead", 3)
    assert "HTTP 410 gone" in row["last_error"]  # last_error keeps the latest only, as before


def test_invariant_32_a_message_delivered_at_once_records_nothing(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    c = _started(conn, store, i)
    assert steps.done(store, conn, i, c.lease_version).applied
    assert fetch(conn, table, i)["errors"] is None


def test_invariant_32_retries_until_dead_record_each_attempt_and_the_exhausted_one(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    for attempt in (1, 2, 3):
        c = _started(conn, store, i, max_attempts=3)
        failed = steps.record_error(store, conn, i, c.lease_version, error=f"e{attempt}", max_attempts=3)
        assert failed.status == ("dead" if attempt == 3 else "pending")
        _due_now(conn, store)
    assert _entries(conn, table, i) == [(1, "e1"), (2, "e2"), (3, "e3")]
    # The entry holds the error as given; last_error says why the row is dead.
    assert fetch(conn, table, i)["last_error"] == "attempts exhausted (3 of 3): e3"


def test_invariant_32_outcomes_that_are_no_failed_attempt_record_nothing(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    c = _started(conn, store, i)
    assert steps.defer(store, conn, i, c.lease_version, delay=0, reason="later", max_age=3600).applied
    _due_now(conn, store)
    c = _started(conn, store, i)
    assert steps.rate_limited(store, conn, i, c.lease_version, delay=0, reason="429", max_age=3600).applied
    conn.execute(sql.SQL("DELETE FROM {}").format(store.table.identifier("_flow")))
    _due_now(conn, store)
    c = _started(conn, store, i)
    assert steps.postpone(store, conn, i, c.lease_version, delay=0, error="no handler").applied
    _due_now(conn, store)
    c = _started(conn, store, i)
    hand_back = Finish(Lease(i, c.lease_version), Step.HAND_BACK)
    assert steps.finish_many(store, conn, [hand_back]).applied == {i}
    # A claim that never started: released at once (a refused publish) ...
    [c] = steps.claim(store, conn, limit=1, lease=LONG, owner="w", max_attempts=5).claimed
    assert steps.release(store, conn, [c]) == 1
    # ... or its lease run out (a task lost in the broker).
    steps.claim(store, conn, limit=1, lease=SHORT, owner="w", max_attempts=5)
    time.sleep(PAST_SHORT)
    steps.claim(store, conn, limit=1, lease=LONG, owner="w", max_attempts=5)
    row = fetch(conn, table, i)
    assert row["attempts"] == 0 and row["errors"] is None
    # A defer past max_defer_age goes dead, its attempt refunded: no failed attempt either.
    _due_now(conn, store)
    c = _started(conn, store, i)
    assert steps.defer(store, conn, i, c.lease_version, delay=60, reason="later", max_age=0).status == "dead"
    assert fetch(conn, table, i)["errors"] is None


def test_invariant_32_only_the_last_20_entries_are_kept(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    for attempt in range(1, 26):
        c = _started(conn, store, i, max_attempts=100)
        error = f"e{attempt} " + "x" * 2000
        assert steps.retry(store, conn, i, c.lease_version, delay=0, error=error, max_attempts=100).applied
        _due_now(conn, store)
    entries = _entries(conn, table, i)
    assert [a for a, _ in entries] == list(range(6, 26))
    assert all(len(e) == 1000 and e.startswith(f"e{a} ") for a, e in entries)


def test_invariant_32_a_lease_run_out_after_the_start_records_the_attempt(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    [c] = steps.claim(store, conn, limit=1, lease=SHORT, owner="a", max_attempts=2).claimed
    assert steps.start(store, conn, i, c.lease_version, lease=SHORT, max_attempts=2) is not None
    time.sleep(PAST_SHORT)  # its worker died mid-handler
    [c] = steps.claim(store, conn, limit=1, lease=SHORT, owner="b", max_attempts=2).claimed  # re-claimed
    assert _entries(conn, table, i) == [(1, LEASE_LOST)]
    assert steps.start(store, conn, i, c.lease_version, lease=SHORT, max_attempts=2) is not None
    time.sleep(PAST_SHORT)  # and again, with no attempt left: the reap makes it dead
    assert steps.claim(store, conn, limit=1, lease=LONG, owner="c", max_attempts=2).reaped == 1
    assert _entries(conn, table, i) == [(1, LEASE_LOST), (2, LEASE_LOST)]
    assert fetch(conn, table, i)["status"] == "dead"


def test_invariant_32_an_unroutable_started_claim_records_its_attempt_once(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table, event_type="gone.event")
    [c] = steps.claim(store, conn, limit=1, lease=LONG, owner="a", max_attempts=5).claimed
    assert steps.start(store, conn, i, c.lease_version, lease=LONG, max_attempts=5) is not None
    conn.execute(sql.SQL("UPDATE {} SET lease_until = now()").format(store.table.identifier()))
    # A claimer with no handler for the type gives the expired lease back: its attempt is over.
    steps.claim(store, conn, limit=1, lease=LONG, owner="b", max_attempts=5, event_types=["other"])
    row = fetch(conn, table, i)
    assert row["status"] == "pending" and row["last_error"].startswith("unroutable:")
    assert _entries(conn, table, i) == [(1, LEASE_LOST)]


def test_invariant_32_a_claim_that_never_started_with_no_attempt_left_records_nothing(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    c = _started(conn, store, i, max_attempts=5)
    assert steps.retry(store, conn, i, c.lease_version, delay=0, error="HTTP 502", max_attempts=5).applied
    _due_now(conn, store)
    [c] = steps.claim(store, conn, limit=1, lease=LONG, owner="w", max_attempts=5).claimed
    # max_attempts lowered by a deploy: the start finds no attempt left and makes the row dead.
    assert steps.start(store, conn, i, c.lease_version, lease=LONG, max_attempts=1) is None
    row = fetch(conn, table, i)
    assert row["status"] == "dead"
    assert _entries(conn, table, i) == [(1, "HTTP 502")]


def test_invariant_32_an_operators_requeue_keeps_the_history(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    c = _started(conn, store, i)
    assert steps.dead(store, conn, i, c.lease_version, error="HTTP 410").status == "dead"
    ops.requeue(conn, table, [i], reason="partner back")
    row = fetch(conn, table, i)
    assert (row["status"], row["attempts"]) == ("pending", 0)
    assert _entries(conn, table, i) == [(1, "HTTP 410")]
    c = _started(conn, store, i)
    assert steps.retry(store, conn, i, c.lease_version, delay=0, error="HTTP 503", max_attempts=5).applied
    assert _entries(conn, table, i) == [(1, "HTTP 410"), (1, "HTTP 503")]
    shown = ops.get_message(conn, table, i)
    assert shown is not None
    assert [(a.attempt, a.error) for a in ops.failed_attempts(shown["errors"])] == [
        (1, "HTTP 503"),
        (1, "HTTP 410"),
    ]
