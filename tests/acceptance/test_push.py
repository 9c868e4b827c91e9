"""Push: producers notify at commit, the worker's listener claims at once; beat is the net.

Real workers, beat and PostgreSQL. Most tests run without beat and with a listener poll of an
hour, so a row can only move because a notification (or a due time the database reported) woke
the listener: a lost wake-up leaves it pending and the test's bounded wait fails.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import psycopg
import pytest
from support.db import calls, statuses

from acceptance.conftest import DEFAULT_EVENT, SETTLE, Harness
from outbox_celery import Event, enqueue, enqueue_many

pytestmark = pytest.mark.slow

HOUR = 3600.0

# The listener is a session on PostgreSQL: what wakes it, how it reconnects and when it retries
# happen there, whatever carries the delivery tasks. Those tests run on Redis; a notification's
# delivery end to end and two claim workers sharing the work run on every broker.
ONE_BROKER = pytest.mark.parametrize("broker_url", ["redis"], indirect=True)


def _listeners(conn: psycopg.Connection[Any]) -> list[int]:
    """Backend pids of this database's outbox listener sessions."""
    return [
        r[0]
        for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name LIKE 'outbox-celery:%:listen' ORDER BY pid"
        ).fetchall()
    ]


def _enqueue_one_per_transaction(h: Harness, n: int, *, notify: bool = True, **kw: Any) -> list[int]:
    ids = []
    for i in range(n):
        with h.conn.transaction():
            ids.append(
                enqueue(
                    h.conn,
                    event_type=DEFAULT_EVENT,
                    payload={"i": i},
                    aggregate_type="thing",
                    aggregate_id=i,
                    table=h.table,
                    notify=notify,
                    **kw,
                )
            )
    return ids


def test_a_notification_alone_gets_an_event_delivered(harness: Harness) -> None:
    # No beat, no poll within the test's reach: only the commit's notification can wake a claim.
    harness.configure(listen_poll=HOUR)
    harness.worker()
    harness.wait(lambda: _listeners(harness.conn), what="listener connected")
    ids = _enqueue_one_per_transaction(harness, 20)
    harness.wait_finished(20)
    assert Counter(c["outbox_id"] for c in calls(harness.conn)) == dict.fromkeys(ids, 1)


@ONE_BROKER
def test_listener_recovers_after_pg_terminate_backend_and_claims_once_on_reconnect(
    harness: Harness,
) -> None:
    harness.configure(listen_poll=HOUR)
    worker = harness.worker()
    [first] = harness.wait(lambda: _listeners(harness.conn), what="listener connected")
    # Committed silently: no notification announces it, so only the claim that follows a
    # (re)connect can find it.
    with harness.conn.transaction():
        [silent] = enqueue_many(
            harness.conn,
            [Event(DEFAULT_EVENT, {"i": 0}, "thing", 0)],
            table=harness.table,
            notify=False,
        )
    harness.conn.execute("SELECT pg_terminate_backend(%s)", [first])
    harness.wait(
        lambda: (pids := _listeners(harness.conn)) and first not in pids, what="listener reconnected"
    )
    harness.wait_finished(1)
    assert [c["outbox_id"] for c in calls(harness.conn)] == [silent]
    # And it listens again: a notified event goes through the new session.
    _enqueue_one_per_transaction(harness, 3)
    harness.wait_finished(4)
    assert "reconnecting" in worker.log()


@ONE_BROKER
def test_a_missed_notification_is_picked_up_by_the_beat_safety_interval(harness: Harness) -> None:
    harness.configure(listen_poll=HOUR, claim_interval=1.0)
    harness.worker()
    harness.wait(lambda: _listeners(harness.conn), what="listener connected")
    harness.beat()
    ids = _enqueue_one_per_transaction(harness, 5, notify=False)
    harness.wait_finished(5)
    assert sorted(c["outbox_id"] for c in calls(harness.conn)) == ids


def test_two_claim_workers_deliver_every_event_once_without_beat(harness: Harness) -> None:
    # Both listeners wake on every commit; the claim lock lets one claim at a time and the other
    # must try again after it (its notification may have come in while the first run had
    # already read the table), or a row stays pending: there is no beat here to save it.
    harness.configure(listen_poll=HOUR, lease=30.0)
    harness.worker(name="w1")
    harness.worker(name="w2")
    harness.wait(lambda: len(_listeners(harness.conn)) == 2, what="two listeners connected")
    ids = _enqueue_one_per_transaction(harness, 300)
    harness.wait_finished(300)
    seen = calls(harness.conn)
    assert Counter(c["outbox_id"] for c in seen) == dict.fromkeys(ids, 1)
    assert {r["attempts"] for r in harness.rows()} == {1}
    assert len({c["hostname"] for c in seen}) == 2


@ONE_BROKER
def test_delayed_events_and_backoff_wake_the_listener_when_due(harness: Harness) -> None:
    # Nothing notifies when a delay or a backoff runs out: the listener sleeps until the due time
    # the database reports (DESIGN invariant 13: the database's clock).
    harness.configure(listen_poll=HOUR, backoff_base=1.0, backoff_cap=1.0)
    harness.worker()
    harness.wait(lambda: _listeners(harness.conn), what="listener connected")
    [delayed] = _enqueue_one_per_transaction(harness, 1, delay=2.0)
    [retried] = harness.enqueue(1, payload={"mode": "retry", "times": 1})
    harness.wait_finished(2)
    by_id = {r["id"]: r for r in harness.rows()}
    assert by_id[retried]["attempts"] == 2
    first_call = {c["outbox_id"]: c["started_at"] for c in reversed(calls(harness.conn))}
    assert first_call[delayed] >= by_id[delayed]["available_at"]


@ONE_BROKER
def test_listen_off_starts_no_listener_and_beat_still_delivers(harness: Harness) -> None:
    harness.configure(listen=False, claim_interval=1.0)
    worker = harness.worker()
    harness.enqueue(3)
    harness.wait(lambda: "ready" in worker.log(), what="worker ready")
    assert _listeners(harness.conn) == []
    assert statuses(harness.conn, harness.table)["pending"] == 3
    harness.beat()
    harness.wait_finished(3)
    assert _listeners(harness.conn) == []


@ONE_BROKER
def test_a_listener_that_cannot_connect_never_stops_beat_delivery(harness: Harness) -> None:
    # Port 9 (discard) refuses connections: the listener keeps retrying with backoff.
    harness.configure(listen_dsn="postgresql://nobody@127.0.0.1:9/none", claim_interval=1.0)
    worker = harness.worker()
    harness.beat()
    harness.enqueue(5)
    harness.wait_finished(5, SETTLE)
    worker.wait_for_log("reconnecting")
    assert _listeners(harness.conn) == []


@ONE_BROKER
def test_a_claim_held_off_by_another_run_is_retried_once_that_run_ends(harness: Harness) -> None:
    # Another claim run (here: this test's session holding the per-table claim lock, as a
    # beat-triggered run in a pool process would) may have read the table before the notifying
    # transaction committed. The listener must try again after it, not drop the wake-up.
    harness.configure(listen_poll=HOUR)
    harness.worker()
    harness.wait(lambda: _listeners(harness.conn), what="listener connected")
    with psycopg.connect(harness.dsn, autocommit=True) as other:
        store = harness.outbox.store
        with other.transaction():  # the claim lock lives as long as this transaction
            # The worker's own first claim (at start) may hold the lock a moment: wait for it.
            harness.wait(lambda: store.try_claim_lock(other) or None, what="the claim lock")
            ids = _enqueue_one_per_transaction(harness, 3)
            time.sleep(1.0)  # the listener wakes, finds the lock taken, and must not give up
            assert statuses(harness.conn, harness.table)["pending"] == 3
    harness.wait_finished(3)
    assert sorted(c["outbox_id"] for c in calls(harness.conn)) == ids
