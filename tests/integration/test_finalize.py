"""Fenced finalizers: done, retryable, defer, permanent (DESIGN invariants 6, 7, 8)."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from psycopg import sql
from support import steps

from outbox_celery import Claimed, Store
from outbox_celery.db.completer import START_KEEP

from .helpers import LONG, PAST_SHORT, SHORT, add, claim_ids, fetch


def started(conn: psycopg.Connection[Any], store: Store, outbox_id: int, max_attempts: int = 5) -> Claimed:
    """Claim ``outbox_id`` (the only due row) and start it."""
    [c] = steps.claim(store, conn, limit=1, lease=LONG, owner="w", max_attempts=max_attempts).claimed
    assert c.id == outbox_id
    assert steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=max_attempts) is not None
    return c


@pytest.mark.parametrize("table", ["outbox", "events.Out Box"])
def test_done_finishes_the_row_for_good(conn: psycopg.Connection[Any], store: Store, table: str) -> None:
    [i] = add(conn, table=table)
    c = started(conn, store, i)
    assert steps.done(store, conn, i, c.lease_version).applied
    row = fetch(conn, table, i)
    assert row["status"] == "done"
    assert row["lease_until"] is None
    assert row["done_at"] is not None
    assert row["attempts"] == 1
    assert claim_ids(store, conn) == []
    assert store.get_stats()["done"] == 1


def test_invariant_6_retryable_keeps_the_attempt_and_backs_off_by_the_database_clock(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    c = started(conn, store, i)
    status = steps.retry(store, conn, i, c.lease_version, delay=30, error="HTTP 503", max_attempts=5).status
    assert status == "pending"
    row = fetch(conn, table, i)
    assert row["status"] == "pending"
    assert row["attempts"] == 1
    assert 28 < row["available_in"] <= 30
    assert row["lease_until"] is None
    assert row["last_error"] == "HTTP 503"
    assert claim_ids(store, conn) == []
    assert store.get_stats()["retried"] == 1


def test_invariant_6_retry_delay_is_honored_then_the_next_attempt_counts(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    c = started(conn, store, i)
    # An HTTP 429 Retry-After, here a short one.
    assert (
        steps.retry(store, conn, i, c.lease_version, delay=SHORT, error="HTTP 429", max_attempts=5).status
        == "pending"
    )
    time.sleep(PAST_SHORT)
    [c2] = steps.claim(store, conn, limit=1, lease=LONG, owner="w", max_attempts=5).claimed
    assert (c2.id, c2.lease_version) == (i, 2)
    msg = steps.start(store, conn, i, c2.lease_version, lease=LONG, max_attempts=5)
    assert msg is not None
    assert msg.attempts == 2


def test_invariant_6_retryable_goes_dead_at_max_attempts(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    for attempt in (1, 2):
        c = started(conn, store, i, max_attempts=3)
        assert (
            steps.retry(store, conn, i, c.lease_version, delay=0, error=f"e{attempt}", max_attempts=3).status
            == "pending"
        )
        assert fetch(conn, table, i)["attempts"] == attempt
    c = started(conn, store, i, max_attempts=3)
    assert (
        steps.retry(store, conn, i, c.lease_version, delay=0, error="HTTP 502", max_attempts=3).status
        == "dead"
    )
    row = fetch(conn, table, i)
    assert (row["status"], row["attempts"]) == ("dead", 3)
    assert row["last_error"].startswith("attempts exhausted (3 of 3)")
    assert row["last_error"].endswith("HTTP 502")
    assert row["lease_until"] is None
    assert claim_ids(store, conn, max_attempts=3) == []


def test_invariant_7_defer_refunds_the_attempt_and_waits(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    c = started(conn, store, i)
    assert fetch(conn, table, i)["attempts"] == 1
    assert (
        steps.defer(store, conn, i, c.lease_version, delay=45, reason="payment pending", max_age=3600).status
        == "pending"
    )
    row = fetch(conn, table, i)
    assert row["status"] == "pending"
    assert row["attempts"] == 0
    assert 43 < row["available_in"] <= 45
    assert row["last_error"] == "deferred: payment pending"
    assert row["lease_until"] is None
    assert claim_ids(store, conn) == []
    assert store.get_stats()["deferred"] == 1


def test_invariant_7_defers_never_use_up_attempts(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    for _ in range(4):
        c = started(conn, store, i, max_attempts=2)
        assert (
            steps.defer(store, conn, i, c.lease_version, delay=0, reason="not yet", max_age=3600).status
            == "pending"
        )
    row = fetch(conn, table, i)
    assert (row["status"], row["attempts"], row["lease_version"]) == ("pending", 0, 4)


def test_invariant_7_defer_past_max_defer_age_goes_dead(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    c = started(conn, store, i)
    assert (
        steps.defer(store, conn, i, c.lease_version, delay=120, reason="no stock", max_age=60).status
        == "dead"
    )
    row = fetch(conn, table, i)
    assert row["status"] == "dead"
    assert row["last_error"] == "deferred past max_defer_age: no stock"
    assert row["lease_until"] is None
    assert claim_ids(store, conn) == []


def test_invariant_7_max_defer_age_counts_from_created_at(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    time.sleep(PAST_SHORT)
    c = started(conn, store, i)
    # A zero delay still lands past created_at + max_age: the message is older than that.
    assert (
        steps.defer(store, conn, i, c.lease_version, delay=0, reason="still no stock", max_age=SHORT).status
        == "dead"
    )
    assert fetch(conn, table, i)["status"] == "dead"


def test_invariant_8_permanent_failure_is_dead_and_never_claimed(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    c = started(conn, store, i)
    assert steps.dead(store, conn, i, c.lease_version, error="HTTP 400: no such mailbox").applied
    row = fetch(conn, table, i)
    assert (row["status"], row["last_error"]) == ("dead", "HTTP 400: no such mailbox")
    assert row["lease_until"] is None
    assert store.get_stats()["dead"] == 1
    [other] = add(conn, table=table)
    # Later claims (and reaps) take the other row and never the dead one.
    assert claim_ids(store, conn, lease=SHORT) == [other]
    # Started, then its worker died: the next claim takes it straight back.
    assert steps.start(store, conn, other, 1, lease=SHORT, max_attempts=5) is not None
    time.sleep(PAST_SHORT)
    assert claim_ids(store, conn, lease=SHORT) == [other]
    assert fetch(conn, table, i)["status"] == "dead"
    assert fetch(conn, table, i)["lease_version"] == 1


def test_invariant_31_a_failed_attempt_backs_off_with_its_error_and_goes_dead_at_max_attempts(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    c = started(conn, store, i, max_attempts=2)
    won = steps.record_error(store, conn, i, c.lease_version, error="KeyError: 'x'", delay=30, max_attempts=2)
    assert won.status == "pending"
    row = fetch(conn, table, i)
    assert (row["status"], row["last_error"], row["attempts"], row["lease_until"]) == (
        "pending",
        "KeyError: 'x'",
        1,
        None,
    )
    assert 28 < row["available_in"] <= 30  # the backoff, not the lease
    assert store.get_stats()["errors"] == 1
    conn.execute(sql.SQL("UPDATE {} SET available_at = now()").format(store.table.identifier()))
    c = started(conn, store, i, max_attempts=2)
    won = steps.record_error(store, conn, i, c.lease_version, error="KeyError: 'x'", delay=30, max_attempts=2)
    assert won.status == "dead"
    row = fetch(conn, table, i)
    assert (row["status"], row["attempts"]) == ("dead", 2)
    assert row["last_error"] == "attempts exhausted (2 of 2): KeyError: 'x'"


def test_invariant_31_a_handler_that_raises_a_plain_exception_is_retried_after_the_backoff(
    conn: psycopg.Connection[Any], table: str, migrated_dsn: str
) -> None:
    from celery import Celery

    from outbox_celery import Message, Outbox

    store = Store(table)
    outbox = Outbox(
        Celery("plain-error"), dsn=migrated_dsn, table=table, store=store, retry=lambda a, e: 45.0
    )

    @outbox.handler("thing.happened")
    def broken(message: Message) -> None:
        raise ValueError("no such customer")

    [i] = add(conn, table=table)
    try:
        [c] = steps.claim(store, conn, limit=1, lease=LONG, owner="w", max_attempts=5).claimed
        with pytest.raises(ValueError, match="no such customer"):
            outbox.deliver(i, c.lease_version)  # the Celery task fails
        row = fetch(conn, table, i)
        assert (row["status"], row["attempts"], row["lease_until"]) == ("pending", 1, None)
        assert 43 < row["available_in"] <= 45
        assert row["last_error"].startswith("ValueError: no such customer\nTraceback")
    finally:
        outbox.close()


def test_postpone_waits_with_the_attempt_refunded(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    c = started(conn, store, i)
    assert steps.postpone(
        store, conn, i, c.lease_version, delay=60, error="no handler for thing.happened"
    ).applied
    row = fetch(conn, table, i)
    assert (row["status"], row["attempts"]) == ("pending", 0)
    assert 58 < row["available_in"] <= 60
    assert row["last_error"] == "no handler for thing.happened"
    assert claim_ids(store, conn) == []


def test_relaxed_commit_applies_to_start_and_done_only_when_the_store_owns_the_transaction(
    conn: psycopg.Connection[Any], table: str
) -> None:
    relaxed, durable = Store(table), Store(table, relaxed_commit=False)
    assert relaxed._commit_mode(conn) == "off"
    assert durable._commit_mode(conn) is None
    with conn.transaction():
        # Inside the caller's transaction the caller decides how it commits.
        assert relaxed._commit_mode(conn) is None
    [i] = add(conn, table=table)
    [c] = steps.claim(relaxed, conn, limit=1, lease=LONG, owner="w", max_attempts=5).claimed
    with conn.transaction():
        # The statement sets synchronous_commit for its own transaction only.
        params = {
            "ids": [i],
            "lease_versions": [c.lease_version],
            "lease": LONG,
            "keep": START_KEEP,
            "max_attempts": 5,
            "starter": "w",
            "inline_share": 1,
        }
        conn.execute(relaxed._q["start"], {**params, "commit_mode": "off"})
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("off",)
    assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
    assert fetch(conn, table, i)["attempts"] == 1


def test_dispatcher_store_follows_the_relaxed_commit_setting() -> None:
    from outbox_celery import OutboxConfig
    from outbox_celery.testing import InProcess

    def no_connection() -> Any:
        raise AssertionError("not used")

    assert InProcess(OutboxConfig(), no_connection, {}).store.relaxed_commit is True
    assert InProcess(OutboxConfig(relaxed_commit=False), no_connection, {}).store.relaxed_commit is False


def test_invariant_6_a_retry_policy_given_to_the_outbox_decides_the_wait_unless_the_error_carries_one(
    conn: psycopg.Connection[Any], table: str, migrated_dsn: str
) -> None:
    from celery import Celery

    from outbox_celery import Message, Outbox, Outcome, RetryableError

    asked: list[tuple[int, str]] = []

    def policy(attempt: int, error: BaseException) -> float:
        asked.append((attempt, str(error)))
        return 120.0

    store = Store(table)
    outbox = Outbox(Celery("retry-policy"), dsn=migrated_dsn, table=table, store=store, retry=policy)
    delays = iter([None, 40.0])

    @outbox.handler("thing.happened")
    def flaky(message: Message) -> None:
        raise RetryableError("HTTP 503", delay=next(delays))

    assert outbox.store is store
    [i] = add(conn, table=table)
    try:
        [c] = steps.claim(store, conn, limit=1, lease=LONG, owner="w", max_attempts=5).claimed
        assert outbox.deliver(i, c.lease_version) == Outcome.RETRY
        assert asked == [(1, "HTTP 503")]
        assert 118 < fetch(conn, table, i)["available_in"] <= 120
        conn.execute(sql.SQL("UPDATE {} SET available_at = now()").format(store.table.identifier()))
        [c] = steps.claim(store, conn, limit=1, lease=LONG, owner="w", max_attempts=5).claimed
        assert outbox.deliver(i, c.lease_version) == Outcome.RETRY
        assert asked == [(1, "HTTP 503")]  # a Retry-After of its own wins over the policy
        assert 38 < fetch(conn, table, i)["available_in"] <= 40
    finally:
        outbox.close()
