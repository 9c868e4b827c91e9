"""Batched ``done`` writes in real prefork workers (``done_batch_delay``), made to happen.

A delivery worker process holds the ``done`` of handled unordered messages for up to
``done_batch_delay`` and writes them in one fenced statement. The tests widen that window so a
kill or a shutdown lands inside it:

* SIGKILL inside the window: the messages' Celery tasks were acknowledged, their rows are still
  ``processing``; after the lease the claim takes them again and they are delivered once more.
  Nothing is lost (DESIGN invariant 2); the duplicate is the documented price.
* A warm shutdown inside the window writes what the process held: one run each, no redelivery.
* Ordered messages never wait: their done moves the key's head.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from support.db import calls, statuses
from support.processes import CeleryProcess

from acceptance.conftest import Harness, HarnessFactory

pytestmark = pytest.mark.slow

LEASE = 12.0
WINDOW = 2.9  # below lease / 4


def _handled(harness: Harness, n: int) -> bool:
    return sum(1 for c in calls(harness.conn) if c["result"] == "ok") >= n


def _held(harness: Harness) -> tuple[list[int], CeleryProcess]:
    """Three messages handled by a prefork worker that still holds their done."""
    harness.configure(lease=LEASE, done_batch_delay=WINDOW)
    ids = harness.enqueue(3)
    worker = harness.worker(concurrency=2)
    harness.beat()
    harness.wait(lambda: _handled(harness, len(ids)), what="every handler to finish")
    # Handled and acknowledged, but the done is still held by the pool processes.
    assert statuses(harness.conn, harness.table)["processing"] == len(ids)
    return ids, worker


def test_a_worker_killed_while_it_holds_done_writes_loses_nothing(harness: Harness) -> None:
    ids, worker = _held(harness)
    worker.kill()

    harness.worker(concurrency=2, name="after")
    harness.wait_finished(len(ids), timeout=LEASE + 30)
    rows = {r["id"]: r for r in harness.rows()}
    assert {r["status"] for r in rows.values()} == {"done"}
    # Each ran again under a new claim after its lease: at least once, nothing lost.
    runs = Counter(c["outbox_id"] for c in calls(harness.conn) if c["result"] == "ok")
    assert runs == dict.fromkeys(ids, 2)
    assert all((rows[i]["attempts"], rows[i]["lease_version"]) == (2, 2) for i in ids)


def test_a_warm_shutdown_writes_the_done_a_worker_holds(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    # One broker: what is held lives in the pool processes, whatever the broker (the kill
    # above runs on both).
    harness = harness_factory(redis_url)
    ids, worker = _held(harness)
    started = time.monotonic()
    worker.stop(timeout=LEASE)

    # Written at shutdown, well inside the lease: no second run.
    assert statuses(harness.conn, harness.table) == {"done": len(ids)}
    assert time.monotonic() - started < LEASE
    rows = harness.rows()
    assert all((r["attempts"], r["lease_version"]) == (1, 1) for r in rows)
    assert sorted(c["outbox_id"] for c in calls(harness.conn)) == ids


def test_an_ordered_done_is_never_held_but_an_unordered_one_is(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    harness = harness_factory(redis_url)
    # Ordered: the done moves the key's head, so the key's next message waits on it. It is
    # written as the handler returns, not a window later; an unordered one beside it waits.
    harness.configure(lease=LEASE, done_batch_delay=WINDOW)
    first, second = harness.enqueue(2, ordering_key="k")
    [loose] = harness.enqueue(1)
    harness.worker(concurrency=2)
    harness.beat()
    harness.wait_finished(3)
    ended = {c["outbox_id"]: c["finished_at"] for c in calls(harness.conn)}
    rows = {r["id"]: r for r in harness.rows()}
    held = {i: (rows[i]["done_at"] - ended[i]).total_seconds() for i in (first, second, loose)}
    assert held[first] < WINDOW / 2 and held[second] < WINDOW / 2, held
    assert held[loose] > WINDOW / 2, held
