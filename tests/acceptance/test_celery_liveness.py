"""Liveness with real workers and beat (DESIGN invariants 10, 12, 16): lost tasks never hold the
outbox still.

A claim keeps handing out rows while nobody delivers them (a deploy that stops every delivery
worker for several leases, a queue with no consumer): their tasks expire or sit in a queue
nobody reads. The in-flight bound counts live leases only and the claim always takes expired
leases back, so once workers return everything ends done, and lost tasks spend no attempt.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from support.db import calls, statuses

from acceptance.conftest import DEFAULT_EVENT, Harness
from outbox_celery import ops

pytestmark = pytest.mark.slow

BOUND = 10
LEASE = 2.0
ORPHAN = "orphan.event"


def _attempts_match_handler_runs(harness: Harness) -> None:
    """Every attempt a row spent is a handler run the workers recorded: none went to lost tasks."""
    runs = Counter(c["outbox_id"] for c in calls(harness.conn))
    spent = {r["id"]: r["attempts"] for r in harness.rows() if r["attempts"]}
    assert spent == dict(runs)


def test_invariant_16_a_deploy_outage_of_several_leases_does_not_stop_the_outbox(harness: Harness) -> None:
    # Beat and the claim worker keep running while every delivery worker is gone for more than
    # three leases, with a backlog many times the bound: the claim fills the bound with rows
    # whose tasks nobody starts. Were those expired leases counted against the bound, the claim
    # run would stop before it could take them back: for good (invariant 16).
    harness.configure(lease=LEASE, max_in_flight=BOUND, batch_size=BOUND, adaptive_in_flight=False)
    ids = harness.enqueue(8 * BOUND)
    harness.worker([harness.claim_queue], name="claimer", concurrency=1)
    harness.beat()
    harness.wait(
        lambda: statuses(harness.conn, harness.table)["processing"] >= BOUND,
        what="the claim filled the in-flight bound",
    )
    time.sleep(3 * LEASE + 1.0)
    assert statuses(harness.conn, harness.table)["done"] == 0

    harness.worker([harness.default_queue], name="delivery")
    harness.wait_finished(len(ids), timeout=60.0)

    rows = harness.rows()
    assert {r["status"] for r in rows} == {"done"}
    _attempts_match_handler_runs(harness)
    assert max(r["lease_version"] for r in rows) > 1, "no lease expired: the outage was not seen"


def test_invariant_16_an_event_type_whose_queue_has_no_consumer_does_not_freeze_the_others(
    harness: Harness,
) -> None:
    # The orphan's rows are older, so the claim hands them out first, again and again; nobody
    # consumes their queue. The other event type must still be delivered, and the orphan's rows
    # must spend no attempt and never go dead.
    harness.configure(
        routes={DEFAULT_EVENT: None, ORPHAN: harness.q("outbox.orphan")},
        lease=LEASE,
        max_in_flight=BOUND,
        batch_size=BOUND,
        adaptive_in_flight=False,
    )
    orphans = harness.enqueue(3 * BOUND, event_type=ORPHAN)
    ids = harness.enqueue(6 * BOUND)
    harness.worker([harness.claim_queue, harness.default_queue])
    harness.beat()

    def delivered() -> bool:
        done = {r["id"] for r in harness.rows() if r["status"] == "done"}
        return done >= set(ids)

    harness.wait(delivered, timeout=60.0, what="every message of the consumed queue delivered")
    by_id = {r["id"]: r for r in harness.rows()}
    assert {by_id[i]["status"] for i in orphans} <= {"pending", "processing"}
    assert {by_id[i]["attempts"] for i in orphans} == {0}
    assert max(by_id[i]["lease_version"] for i in orphans) >= 1
    _attempts_match_handler_runs(harness)
    # Visible to the operator: claims of the orphan's event type that no worker started.
    types = {e.event_type: e for e in ops.stats(harness.conn, harness.table).event_types}
    assert types[ORPHAN].unstarted > 0
