"""What Celery really puts on the wire (DESIGN §4): read off the broker before any worker.

Delivery tasks: deterministic id ``<table>:<id>:v<version>``, ``expires`` at the lease end plus the
clock-skew allowance, a shadow name per event type, readable args, time limits below the lease,
routed to the event type's queue. The claim task: on the claim queue, expiring after one interval
plus the allowance.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from support.brokers import queue_length, take_messages

from acceptance.conftest import Harness

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("table", ["outbox", "ev ents.Out box"])
def test_delivery_task_messages_carry_ids_expiry_names_and_routes(harness: Harness) -> None:
    orders = harness.q("orders")
    harness.configure(lease=45.0, routes={"order.created": orders, "thing.happened": None})
    created = harness.enqueue(2, event_type="order.created")
    [thing] = harness.enqueue(1)
    run = harness.outbox.claim()
    assert (run.claimed, run.published) == (3, 3)

    rows = {r["id"]: r for r in harness.rows()}
    taken = take_messages(harness.broker_url, orders, expect=2)
    taken += take_messages(harness.broker_url, harness.default_queue, expect=1)
    assert sorted((m.queue, m.args[0]) for m in taken) == sorted(
        [(orders, i) for i in created] + [(harness.default_queue, thing)]
    )
    for m in taken:
        i = m.args[0]
        event_type = rows[i]["event_type"]
        assert m.args == [i, 1]
        assert m.headers["id"] == f"{harness.table}:{i}:v1"
        assert m.headers["task"] == "outbox.deliver"
        assert m.headers["shadow"] == f"outbox.deliver[{event_type}]"
        assert m.headers["argsrepr"] == repr((i, 1))
        assert m.headers["retries"] == 0
        # Invariant 13: the lease end plus the skew allowance (the fence decides staleness).
        skew = timedelta(seconds=harness.outbox.config.max_clock_skew)
        assert datetime.fromisoformat(m.headers["expires"]) == rows[i]["lease_until"] + skew
        hard, soft = m.headers["timelimit"]
        assert 0 < soft < hard < 45.0
        assert m.headers["outbox_event_type"] == event_type
    assert queue_length(harness.broker_url, orders) == 0
    assert queue_length(harness.broker_url, harness.default_queue) == 0


def test_beat_sends_the_claim_task_to_the_claim_queue_expiring_after_the_skew_allowance(
    harness: Harness,
) -> None:
    harness.configure(claim_interval=0.5)
    queue_length(harness.broker_url, harness.claim_queue)  # declared, as a worker would
    started = datetime.now(UTC)
    beat = harness.beat()
    taken = take_messages(harness.broker_url, harness.claim_queue, expect=2, timeout=30)
    beat.stop()
    taken_at = datetime.now(UTC)
    assert len(taken) == 2
    for m in taken:
        assert m.headers["task"] == "outbox.claim"
        expires = datetime.fromisoformat(m.headers["expires"])
        # Sent between start and now, expiring one interval plus the skew allowance after it
        # was sent (invariant 13: a worker whose clock is ahead of beat's still runs it).
        allowance = timedelta(seconds=0.5 + harness.outbox.config.max_clock_skew)
        assert started + allowance < expires <= taken_at + allowance
    first, second = (datetime.fromisoformat(m.headers["expires"]) for m in taken)
    assert second > first
