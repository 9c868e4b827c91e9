"""Ordered messages across two workers (invariant 9)."""

from __future__ import annotations

import itertools

import pytest
from support.db import calls

from acceptance.conftest import Harness

pytestmark = pytest.mark.slow


def test_ordered_messages_of_one_key_are_handled_in_order_across_two_workers(harness: Harness) -> None:
    slow = {"mode": "sleep", "seconds": 0.05}
    first_key = harness.enqueue(10, ordering_key="order:1", payload=slow)
    unordered = harness.enqueue(10)
    second_key = harness.enqueue(10, ordering_key="order:2", payload=slow)
    harness.worker(name="a", concurrency=2)
    harness.worker(name="b", concurrency=2)
    harness.beat()
    harness.wait_finished(30)

    seen = calls(harness.conn)
    for key in (first_key, second_key):
        runs = [c for c in seen if c["outbox_id"] in key]
        assert [c["outbox_id"] for c in runs] == key, "handled out of id order"
        for before, after in itertools.pairwise(runs):
            assert after["started_at"] >= before["finished_at"], "two messages of one key overlapped"
    assert sorted(c["outbox_id"] for c in seen if c["outbox_id"] in unordered) == unordered
    # Both workers took part: the order held across processes, not thanks to a single consumer.
    ordered_hosts = {c["hostname"].split("@")[0] for c in seen if c["outbox_id"] not in unordered}
    assert ordered_hosts == {"a", "b"}
    assert {r["attempts"] for r in harness.rows()} == {1}
