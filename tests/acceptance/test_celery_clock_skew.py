"""Invariant 13: no worker or beat clock decides liveness.

Worker processes run under ``libfaketime`` with their wall clock 5 s ahead of, or behind, beat,
PostgreSQL and the broker. Celery checks a task's ``expires`` against the worker's own clock, so
an ``expires`` as short as one claim interval or as the lease end makes skewed workers discard
claims or deliveries; every message must still be delivered, once per lease.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from support.db import calls
from support.faketime import clock_offset, faketime_env

from acceptance.conftest import Harness, HarnessFactory

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("offset", ["+5s", "-5s"])
def test_invariant_13_workers_with_a_skewed_clock_deliver_everything(
    harness_factory: HarnessFactory, redis_url: str, offset: str
) -> None:
    skew = faketime_env(offset)
    shift = clock_offset(skew)
    assert abs(abs(shift) - 5.0) < 1.0, f"libfaketime did not shift the clock: {shift:+.2f}s"
    h: Harness = harness_factory(redis_url)
    # A lease shorter than the skew: a delivery expiring at the lease end (database time) is
    # already past on a clock 5 s ahead.
    h.configure(lease=4.0, claim_interval=0.3)
    ids = h.enqueue(60)
    h.procs.worker(h.queues, env={**h.spec.env(), **skew}, concurrency=2)
    h.beat()
    h.wait_finished(60, timeout=60)
    rows = h.rows()
    assert {r["status"] for r in rows} == {"done"}
    seen = calls(h.conn)
    assert set(Counter(c["outbox_id"] for c in seen)) == set(ids)


def test_invariant_13_a_delivery_worker_ahead_of_the_claim_worker_still_delivers(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    """Claims on a correct clock, deliveries on a worker 5 s ahead (lease 4 s)."""
    skew = faketime_env("+5s")
    h: Harness = harness_factory(redis_url)
    h.configure(lease=4.0, claim_interval=0.3)
    ids = h.enqueue(40)
    h.procs.worker([h.claim_queue], env=h.spec.env(), name="claims", concurrency=1)
    h.procs.worker([h.default_queue], env={**h.spec.env(), **skew}, name="ahead", concurrency=2)
    h.beat()
    h.wait_finished(40, timeout=60)
    assert {c["outbox_id"] for c in calls(h.conn)} == set(ids)


def test_claim_tasks_piled_up_behind_a_stalled_claim_worker_are_coalesced(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    """Their ``expires`` leaves minutes for skew, so claims queue up while a claim worker is
    stopped; run back to back after it drained the table, they return at once."""
    h: Harness = harness_factory(redis_url)
    h.configure(claim_interval=1.0)
    claim = h.outbox.claim_task
    first = claim.run()
    assert first["stopped_by"] == "drained" and not first["skipped"]
    piled = [claim.run() for _ in range(5)]
    assert [r["stopped_by"] for r in piled] == ["coalesced"] * 5
    h.enqueue(3)
    time.sleep(0.6)  # half an interval later the next one claims again
    again = claim.run()
    assert again["claimed"] == 3 and again["stopped_by"] == "drained"
