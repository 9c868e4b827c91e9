"""Subscriptions with real workers (DESIGN invariant 28): one event type, three named handlers
on three queues; each receives every event as sent and in order per key; one dead-lettering or
paused leaves the others alone; a subscription added later gets later events unless it
replays; a producer process that never imported the handlers fans out all the same.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from datetime import datetime
from typing import Any

import pytest
from support.db import calls

from acceptance.conftest import Harness
from outbox_celery.ops import subscriptions

pytestmark = pytest.mark.slow

PAID = "order.paid"
NAMES = ("receipt", "search", "warehouse")


def _three(harness: Harness, **limits: Any) -> None:
    harness.configure(subscriptions={PAID: {n: harness.q(n) for n in NAMES}}, limits=limits)


def _runs(harness: Harness, route: str) -> list[dict[str, Any]]:
    return [c for c in calls(harness.conn) if c["event_type"] == route]


def test_invariant_28_three_subscriptions_on_three_queues_each_get_every_event_in_order(
    harness: Harness,
) -> None:
    _three(harness)
    harness.worker(name="a", concurrency=2)
    harness.worker(name="b", concurrency=2)
    harness.beat()
    harness.wait(
        lambda: len(subscriptions.list_subscriptions(harness.conn, harness.table)) == 3, what="registered"
    )
    slow = {"mode": "sleep", "seconds": 0.02}
    ordered = harness.enqueue(8, event_type=PAID, ordering_key="order:1", payload=slow)
    free = harness.enqueue(8, event_type=PAID)
    harness.wait_finished(3 * 16)
    for name in NAMES:
        route = f"{PAID}@{name}"
        runs = _runs(harness, route)
        assert {c["routing_key"] for c in runs} == {harness.q(name)}, "its own queue"
        assert sorted(c["payload_json"] for c in runs) == sorted(
            c["payload_json"] for c in _runs(harness, f"{PAID}@receipt")
        )
        assert len(runs) == 16 and {c["attempts"] for c in runs} == {1}
        keyed = [c for c in runs if '"sleep"' in c["payload_json"]]
        assert [c["payload_json"].count('"i": ') for c in keyed] == [1] * 8
        assert [int(c["payload_json"].split('"i": ')[1].rstrip("}")) for c in keyed] == list(range(8))
        for before, after in itertools.pairwise(keyed):
            assert after["started_at"] >= before["finished_at"], "two messages of one key overlapped"
    # The fact is stored once: one payload per event, every other row reads it.
    rows = harness.rows()
    assert sum(r["payload"] is not None for r in rows) == len(ordered) + len(free) == 16


def test_invariant_28_events_written_before_any_worker_registered_reach_every_subscription(
    harness: Harness,
) -> None:
    """Nothing depends on who started first: events written while the table knew no
    subscription (no worker had started yet) are bare rows; the first worker registers the
    subscriptions at start, and its first claim fans the bare rows out, in order per key."""
    _three(harness)
    assert subscriptions.list_subscriptions(harness.conn, harness.table) == []
    slow = {"mode": "sleep", "seconds": 0.02}
    ordered = harness.enqueue(6, event_type=PAID, ordering_key="order:1", payload=slow)
    free = harness.enqueue(6, event_type=PAID)
    assert {r["event_type"] for r in harness.rows()} == {PAID}  # bare rows, before registration
    harness.worker(concurrency=2)
    harness.beat()
    harness.wait_finished(3 * 12)
    rows = harness.rows()
    assert {r["event_type"] for r in rows} == {f"{PAID}@{n}" for n in NAMES}
    assert sum(r["payload"] is not None for r in rows) == len(ordered) + len(free)
    for name in NAMES:
        runs = _runs(harness, f"{PAID}@{name}")
        assert len(runs) == 12 and {c["attempts"] for c in runs} == {1}
        keyed = [c for c in runs if '"sleep"' in c["payload_json"]]
        assert [int(c["payload_json"].split('"i": ')[1].rstrip("}")) for c in keyed] == list(range(6))
        for before, after in itertools.pairwise(keyed):
            assert after["started_at"] >= before["finished_at"], "two messages of one key overlapped"


def test_invariant_16_a_subscription_nobody_consumes_does_not_slow_its_siblings(harness: Harness) -> None:
    """The in-flight bound is shared by every route, but a route whose tasks no worker starts
    stops taking room from it: once its oldest task waited ``stalled_after``, the claim hands
    it no more rows and leaves its waiting tasks out of the count."""
    _three(harness)
    harness.configure(lease=20.0, claim_interval=0.5, max_in_flight=40, adaptive_in_flight=False)
    nobody = harness.q("warehouse")
    served = [q for q in harness.queues if q != nobody]
    harness.worker(queues=served, concurrency=2)
    harness.beat()
    harness.wait(
        lambda: len(subscriptions.list_subscriptions(harness.conn, harness.table)) == 3, what="registered"
    )
    started = time.monotonic()
    harness.enqueue(200, event_type=PAID)
    harness.wait(
        lambda: (
            sum(r["status"] == "done" for r in harness.rows() if r["event_type"] != f"{PAID}@warehouse")
            == 400
        ),
        timeout=60,
        what="the consumed subscriptions' rows done",
    )
    took = time.monotonic() - started
    # Before the lease of the first stranded tasks ran out: the unconsumed route held nobody back.
    assert took < 20.0, took
    stranded = [r for r in harness.rows() if r["event_type"] == f"{PAID}@warehouse"]
    assert {r["status"] for r in stranded} <= {"pending", "processing"}
    assert {r["attempts"] for r in stranded} == {0}
    harness.procs.started[0].wait_for_log("no worker has started a task of 'order.paid@warehouse'")


def test_invariant_28_one_subscription_dead_lettering_or_paused_does_not_touch_the_others(
    harness: Harness,
) -> None:
    _three(harness)
    harness.outbox.pause(f"{PAID}@warehouse")
    harness.worker(name="a", concurrency=2)
    harness.beat()
    failing = {"for": {"receipt": {"mode": "permanent"}}}
    harness.enqueue(5, event_type=PAID, ordering_key="order:9", payload=failing)
    harness.enqueue(5, event_type=PAID, payload=failing)

    def by_route() -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = {}
        for r in harness.rows():
            out[(r["event_type"], r["status"])] = out.get((r["event_type"], r["status"]), 0) + 1
        return out

    # receipt: its head of order:9 dead (the key blocked there) and the 5 unordered dead;
    # search: everything done; warehouse: paused, nothing claimed.
    harness.wait(lambda: by_route().get((f"{PAID}@search", "done")) == 10, what="search done")
    harness.wait(lambda: by_route().get((f"{PAID}@receipt", "dead")) == 6, what="receipt dead")
    counts = by_route()
    assert counts[(f"{PAID}@receipt", "pending")] == 4
    assert counts[(f"{PAID}@warehouse", "pending")] == 10
    assert not _runs(harness, f"{PAID}@warehouse")
    harness.outbox.resume(f"{PAID}@warehouse")
    harness.wait(lambda: by_route().get((f"{PAID}@warehouse", "done")) == 10, what="warehouse done")


def test_invariant_28_a_later_subscription_gets_later_events_unless_it_replays(harness: Harness) -> None:
    subscriptions.add(harness.conn, harness.table, PAID, "receipt")
    early = harness.enqueue(3, event_type=PAID)
    subscriptions.add(harness.conn, harness.table, PAID, "search", replay_since=datetime(2000, 1, 1))
    _three(harness)
    harness.worker(name="a", concurrency=2)
    harness.beat()
    # The worker adds warehouse at start-up: it gets what is enqueued after that.
    harness.wait(
        lambda: len(subscriptions.list_subscriptions(harness.conn, harness.table)) == 3, what="registered"
    )
    late = harness.enqueue(2, event_type=PAID)
    harness.wait_finished(3 + 3 + 2 * 3)
    got = {n: sorted(c["outbox_id"] for c in _runs(harness, f"{PAID}@{n}")) for n in NAMES}
    assert len(got["receipt"]) == 5 and len(got["search"]) == 5 and len(got["warehouse"]) == 2
    assert set(early + late) <= set(got["receipt"])


PRODUCER = """
import sys, psycopg
from outbox_celery import enqueue
with psycopg.connect(sys.argv[1]) as conn:
    for i in range(4):
        enqueue(conn, event_type="order.paid", payload={"i": i}, aggregate_type="o", aggregate_id=str(i),
                ordering_key="k", table=sys.argv[2])
print("ok")
"""


def test_invariant_28_a_producer_without_the_handlers_fans_out(harness: Harness) -> None:
    _three(harness)
    harness.worker(name="a", concurrency=2)
    harness.beat()
    harness.wait(
        lambda: len(subscriptions.list_subscriptions(harness.conn, harness.table)) == 3, what="registered"
    )
    done = subprocess.run(
        [sys.executable, "-c", PRODUCER, harness.dsn, harness.table],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == "ok", done.stderr
    harness.wait_finished(12)
    for name in NAMES:
        assert [c["payload_json"] for c in _runs(harness, f"{PAID}@{name}")] == [
            f'{{"i": {i}}}' for i in range(4)
        ]
