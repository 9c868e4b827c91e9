"""Backpressure (invariant 16): a backlog many times the in-flight bound drains cleanly."""

from __future__ import annotations

from collections import Counter

import pytest
from support.db import calls, signals

from acceptance.conftest import Harness

pytestmark = pytest.mark.slow

BOUND = 10


def test_a_backlog_of_20x_the_in_flight_bound_drains_without_any_lease_expiring(harness: Harness) -> None:
    # A short lease: had the claim handed Celery more than the workers start within it, tasks
    # would expire in the queue and their rows be re-claimed (lease_version 2) or go dead.
    harness.configure(lease=3.0, max_in_flight=BOUND, batch_size=BOUND)
    ids = harness.enqueue(20 * BOUND, payload={"mode": "sleep", "seconds": 0.01})
    harness.worker(concurrency=2)
    harness.beat()
    harness.wait_finished(len(ids))

    rows = harness.rows()
    assert {r["status"] for r in rows} == {"done"}
    assert max(r["lease_version"] for r in rows) == 1, "a lease ran out: a row was claimed twice"
    assert {r["attempts"] for r in rows} == {1}
    seen = calls(harness.conn)
    assert Counter(c["outbox_id"] for c in seen) == dict.fromkeys(ids, 1)
    # What each handler saw in flight (rows processing) never exceeded the bound, and the bound
    # was what held the backlog back.
    in_flight = [c["in_flight"] for c in seen]
    assert max(in_flight) <= BOUND
    assert max(in_flight) >= BOUND // 2
    assert signals(harness.conn) == []
