"""Beat, workers and the broker delivering for real (DESIGN §4, invariants 10, 11, 14).

Every test runs on Redis and on RabbitMQ (when reachable), with real ``celery worker`` and
``celery beat`` processes of ``support.worker_app``.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from support import steps
from support.db import calls, signals

from acceptance.conftest import Harness, HarnessFactory
from outbox_celery import Store

pytestmark = pytest.mark.slow


def test_beat_and_worker_deliver_500_messages_each_handler_call_seen_once(harness: Harness) -> None:
    harness.configure(lease=30.0)
    ids = harness.enqueue(500)
    harness.worker(concurrency=2)
    harness.beat()
    harness.wait_finished(500)

    rows = harness.rows()
    assert [r["id"] for r in rows] == ids
    assert {r["status"] for r in rows} == {"done"}
    assert all(r["attempts"] == 1 for r in rows)
    assert all(r["lease_until"] is None and r["done_at"] is not None for r in rows)
    seen = calls(harness.conn)
    assert Counter(c["outbox_id"] for c in seen) == dict.fromkeys(ids, 1)
    assert all(c["result"] == "ok" for c in seen)
    # The table's identity (migration 0006) first: distinct across databases.
    prefix = Store(harness.table).key_prefix(harness.conn)
    assert prefix.endswith(f"/public.{harness.table}:")
    assert all(c["idempotency_key"] == f"{prefix}{c['outbox_id']}" for c in seen)
    assert signals(harness.conn) == []
    # Handlers ran in the prefork pool's children, never in the worker's main process.
    [worker] = [p for p in harness.procs.started if p.kind == "worker"]
    assert worker.pid not in {c["pid"] for c in seen}


def test_event_types_land_on_their_queues(harness: Harness) -> None:
    orders, mail = harness.q("orders"), harness.q("mail")
    harness.configure(
        lease=60.0,
        routes={"order.created": orders, "order.paid": orders, "mail.sent": mail, "thing.happened": None},
    )
    by_type = {t: harness.enqueue(4, event_type=t) for t in ("order.created", "order.paid", "mail.sent")}
    by_type["thing.happened"] = harness.enqueue(4)
    harness.worker([harness.claim_queue, orders], name="orders", concurrency=2)
    harness.beat()
    harness.wait_finished(8)
    time.sleep(1.0)  # a few more claim ticks: nothing else may be delivered by this worker

    seen = calls(harness.conn)
    assert {c["event_type"] for c in seen} == {"order.created", "order.paid"}
    assert all(c["hostname"].startswith("orders@") for c in seen)
    assert {c["routing_key"] for c in seen} == {orders}
    waiting = [r for r in harness.rows() if r["event_type"] in ("mail.sent", "thing.happened")]
    # Claimed and handed to the broker, sitting in queues no running worker consumes.
    assert {r["status"] for r in waiting} == {"processing"}
    assert all(r["attempts"] == 0 for r in waiting)

    harness.worker([mail, harness.default_queue], name="rest", concurrency=1)
    harness.wait_finished(16)
    seen = calls(harness.conn)
    rest = [c for c in seen if c["event_type"] in ("mail.sent", "thing.happened")]
    assert sorted(c["outbox_id"] for c in rest) == sorted(by_type["mail.sent"] + by_type["thing.happened"])
    assert all(c["hostname"].startswith("rest@") for c in rest)
    assert {c["routing_key"] for c in rest if c["event_type"] == "mail.sent"} == {mail}
    assert {c["routing_key"] for c in rest if c["event_type"] == "thing.happened"} == {harness.default_queue}
    assert all(r["attempts"] == 1 for r in harness.rows())


def test_a_stale_delivery_task_does_not_call_the_handler(harness: Harness) -> None:
    """Invariant 11: a task whose lease_version was superseded never reaches the handler."""
    [i] = harness.enqueue(1)
    outbox = harness.outbox
    store = outbox.store
    with outbox.connection() as c:
        [first] = steps.claim(store, c, limit=1, lease=60, owner="test", max_attempts=5).claimed
        # Its task never went out (invariant 12): released, then claimed again by a later run.
        assert steps.release(store, c, [first]) == 1
    with outbox.connection() as c:
        [second] = steps.claim(store, c, limit=1, lease=60, owner="test", max_attempts=5).claimed
    assert (first.id, first.lease_version, second.lease_version) == (i, 1, 2)
    worker = harness.worker(concurrency=1)

    # By hand, as a redelivered or duplicated message would arrive; routed by the outbox.
    outbox.deliver_task.apply_async((i, 1))
    worker.wait_for_log(f"outbox id {i} version 1 is stale", timeout=60)
    assert calls(harness.conn) == []
    [r] = harness.rows()
    assert (r["status"], r["lease_version"], r["attempts"]) == ("processing", 2, 0)

    outbox.deliver_task.apply_async((i, 2))
    harness.wait_finished(1)
    [call] = calls(harness.conn)
    assert (call["outbox_id"], call["lease_version"], call["attempts"]) == (i, 2, 1)
    [r] = harness.rows()
    assert (r["status"], r["lease_version"], r["attempts"]) == ("done", 2, 1)


def test_retryable_failures_reschedule_through_available_at_never_celery_retry(harness: Harness) -> None:
    """Invariants 6 and 14: backoff lives in available_at; Celery's retry never runs."""
    harness.configure(max_attempts=4, backoff_base=0.05, backoff_cap=0.2)
    [recovers] = harness.enqueue(1, payload={"mode": "retry", "times": 2})
    [later] = harness.enqueue(1, payload={"mode": "retry", "delay": 3600})
    [exhausts] = harness.enqueue(1, payload={"mode": "retry"})
    harness.worker(concurrency=2)
    harness.beat()
    settled = {recovers: "done", later: "pending", exhausts: "dead"}
    harness.wait(
        lambda: {r["id"]: r["status"] for r in harness.rows() if r["attempts"]} == settled,
        what="retryable rows to settle",
    )
    rows = {r["id"]: r for r in harness.rows()}
    assert (rows[recovers]["attempts"], rows[recovers]["lease_version"]) == (3, 3)
    assert rows[later]["attempts"] == 1
    assert rows[later]["available_in"] > 3500  # the delay the error carried
    assert rows[later]["lease_until"] is None
    assert "scripted retry on attempt 1" in rows[later]["last_error"]
    assert rows[exhausts]["attempts"] == 4
    assert rows[exhausts]["last_error"].startswith("attempts exhausted (4 of 4)")
    per_row = Counter(c["outbox_id"] for c in calls(harness.conn))
    assert per_row == {recovers: 3, later: 1, exhausts: 4}
    # Celery itself never retried nor failed a delivery: every run ended as a normal return.
    assert signals(harness.conn) == []
    logs = harness.procs.logs()
    assert " retry: " not in logs and "Retry in" not in logs


@pytest.mark.parametrize("table", ["ev ents.Out box"])
def test_outcomes_map_to_states_on_the_solo_pool_configured_from_celery_settings(
    redis_url: str, harness_factory: HarnessFactory
) -> None:
    """The solo pool, outbox_* Celery settings, a schema-qualified table needing quotes.

    Redis only: on RabbitMQ, Celery's solo pool sits idle for seconds between late-acked
    messages (a plain Celery app does the same), which docs/celery.md tells users about and
    check_worker_settings warns of; the solo pool's RabbitMQ path is still exercised by
    test_a_stalled_worker_late_finalize_is_fenced.
    """
    harness = harness_factory(redis_url)
    harness.configure(via_celery_conf=True, max_attempts=3, lease=3.0)
    ok = harness.enqueue(10)
    [retried] = harness.enqueue(1, payload={"mode": "retry", "times": 1})
    [permanent] = harness.enqueue(1, payload={"mode": "permanent"})
    [deferred] = harness.enqueue(1, payload={"mode": "defer", "delay": 3600})
    [extended] = harness.enqueue(1, payload={"mode": "extend", "seconds": 45})
    [unexpected] = harness.enqueue(1, payload={"mode": "error", "times": 1})
    worker = harness.worker(pool="solo")
    harness.beat()
    harness.wait_finished(14, statuses_=("done", "dead"))
    harness.wait(lambda: any(r["status"] == "pending" for r in harness.rows()), what="the deferred row")

    rows = {r["id"]: r for r in harness.rows()}
    assert all(rows[i]["status"] == "done" and rows[i]["attempts"] == 1 for i in ok)
    assert (rows[retried]["status"], rows[retried]["attempts"]) == ("done", 2)
    assert (rows[permanent]["status"], rows[permanent]["attempts"]) == ("dead", 1)
    assert "scripted permanent failure" in rows[permanent]["last_error"]
    # Defer: back to pending later, the attempt refunded.
    assert (rows[deferred]["status"], rows[deferred]["attempts"]) == ("pending", 0)
    assert rows[deferred]["available_in"] > 3500
    assert rows[deferred]["last_error"] == "deferred: scripted defer"
    assert rows[extended]["status"] == "done"
    # An unclassified exception: a failed attempt, claimed again after the backoff (version 2).
    assert (rows[unexpected]["status"], rows[unexpected]["attempts"]) == ("done", 2)
    assert rows[unexpected]["lease_version"] == 2
    assert "RuntimeError: scripted unexpected error" in rows[unexpected]["last_error"]
    results = {(c["outbox_id"], c["attempts"]): c["result"] for c in calls(harness.conn)}
    assert results[(extended, 1)] == "extended=True"
    assert results[(unexpected, 1)] == "raised RuntimeError"
    # Solo: handlers ran in the worker's own process; the failure surfaced as a Celery failure.
    assert {c["pid"] for c in calls(harness.conn)} == {worker.pid}
    [failure] = signals(harness.conn, "task_failure")
    assert "scripted unexpected error" in failure["detail"]
    assert signals(harness.conn, "task_retry") == []
    assert "the solo pool does not enforce task time limits" in worker.log()


def test_the_threads_pool_shares_one_connection_pool_and_delivers_each_message_once(
    harness: Harness,
) -> None:
    """Threads share the process's psycopg pool (thread-safe); more threads than connections wait."""
    harness.configure(lease=30.0)
    ids = harness.enqueue(200)
    worker = harness.worker(pool="threads", concurrency=8)
    harness.beat()
    harness.wait_finished(200)

    rows = harness.rows()
    assert {r["status"] for r in rows} == {"done"}
    assert all(r["attempts"] == 1 for r in rows)
    seen = calls(harness.conn)
    assert Counter(c["outbox_id"] for c in seen) == dict.fromkeys(ids, 1)
    # The threads pool runs handlers in the worker's own process.
    assert {c["pid"] for c in seen} == {worker.pid}
    assert "pool_max_size=4 is below the thread pool's concurrency (8)" in worker.log()
