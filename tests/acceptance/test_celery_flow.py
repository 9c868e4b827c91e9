"""Flow control with real workers (DESIGN invariants 22 and 23).

Mostly on Redis: the limits live in the claim, in PostgreSQL, before a Celery message exists, so
nothing here depends on the broker; one test runs the bound on both brokers to show it. Handler
runs are recorded with the database's clock (``handler_calls``), so overlaps and waits are
measured on one clock.
"""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import datetime
from typing import Any

import pytest
from support.db import calls

from acceptance.conftest import DEFAULT_EVENT, Harness, HarnessFactory
from outbox_celery import ops

pytestmark = pytest.mark.slow

LIMITED = "webhook.limited"


@pytest.fixture
def harness(redis_url: str, harness_factory: HarnessFactory) -> Harness:
    """Redis only: the broker plays no part in what a limit bounds."""
    return harness_factory(redis_url)


def max_overlap(runs: list[dict[str, Any]], ends: dict[int, datetime] | None = None) -> int:
    """The most handler runs in progress at once, from their recorded start and finish."""
    events: list[tuple[datetime, int]] = []
    for r in runs:
        end = r["finished_at"] or (ends or {}).get(r["n"])
        assert end is not None, f"run {r['n']} never finished"
        events += [(r["started_at"], 1), (end, -1)]
    # A finish and a start at the same instant do not overlap: finishes first.
    events.sort(key=lambda e: (e[0], e[1]))
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def test_invariant_22_a_concurrency_limit_bounds_handler_runs_across_the_pool(harness: Harness) -> None:
    harness.configure(routes={LIMITED: None, DEFAULT_EVENT: None}, limits={LIMITED: {"concurrency": 2}})
    sleepy = {"mode": "sleep", "seconds": 0.3}
    limited = harness.enqueue(10, event_type=LIMITED, payload=sleepy)
    free = harness.enqueue(4, payload=sleepy)
    harness.worker(concurrency=4)
    harness.wait_finished(14)

    seen = calls(harness.conn)
    limited_runs = [c for c in seen if c["outbox_id"] in limited]
    assert len(limited_runs) == 10
    assert max_overlap(limited_runs) == 2, "a limit of 2 was exceeded (or never reached)"
    # The other type was not held behind the limited one: it used the rest of the pool.
    assert max_overlap([c for c in seen if c["outbox_id"] in free]) >= 2
    assert {r["attempts"] for r in harness.rows()} == {1}


def test_invariant_22_the_bound_holds_across_worker_processes_on_either_broker(
    broker_url: str, harness_factory: HarnessFactory
) -> None:
    """Two workers of two pool processes each, on Redis and RabbitMQ: still at most the limit."""
    harness = harness_factory(broker_url)
    harness.configure(routes={LIMITED: None}, limits={LIMITED: {"concurrency": 2}})
    limited = harness.enqueue(8, event_type=LIMITED, payload={"mode": "sleep", "seconds": 0.25})
    harness.worker(concurrency=2, name="flow-a")
    harness.worker(concurrency=2, name="flow-b")
    harness.wait_finished(8)

    runs = [c for c in calls(harness.conn) if c["outbox_id"] in limited]
    assert len(runs) == 8
    assert max_overlap(runs) == 2, "a limit of 2 was exceeded across the workers (or never reached)"


def test_invariant_24_key_concurrency_bounds_handler_runs_per_key_across_worker_processes(
    harness: Harness,
) -> None:
    harness.configure(routes={LIMITED: None}, limits={LIMITED: {"key_concurrency": 2}})
    sleepy = {"mode": "sleep", "seconds": 0.3}
    keys = ["tenant-1", "tenant-2", "tenant-3"]
    ids = harness.enqueue(24, event_type=LIMITED, payload=sleepy, limit_key=lambda i: keys[i % 3])
    key_of = {outbox_id: keys[i % 3] for i, outbox_id in enumerate(ids)}
    # Two worker processes of four each: eight handlers could run at once, six would be allowed.
    harness.worker(concurrency=4)
    harness.worker(concurrency=4)
    harness.wait_finished(24)

    seen = calls(harness.conn)
    assert sorted(c["outbox_id"] for c in seen) == sorted(ids)
    per_key = {k: max_overlap([c for c in seen if key_of[c["outbox_id"]] == k]) for k in keys}
    assert per_key == dict.fromkeys(keys, 2), f"a key limit of 2 was exceeded (or never reached): {per_key}"
    # The keys ran side by side, not one after the other.
    assert max_overlap(seen) > 2
    assert {r["attempts"] for r in harness.rows()} == {1}


def test_invariant_22_a_killed_workers_slot_comes_back_after_its_lease(harness: Harness) -> None:
    lease = 3.0
    harness.configure(routes={LIMITED: None}, limits={LIMITED: {"concurrency": 1}}, lease=lease)
    worker = harness.worker(concurrency=2)
    [victim] = harness.enqueue(1, event_type=LIMITED, payload={"mode": "kill", "times": 1})
    harness.wait(lambda: calls(harness.conn), what="the victim's first run")
    others = harness.enqueue(3, event_type=LIMITED)
    harness.wait_finished(4)

    runs = calls(harness.conn)
    killed = runs[0]
    assert killed["outbox_id"] == victim and killed["finished_at"] is None
    after = runs[1:]
    assert sorted({r["outbox_id"] for r in after}) == sorted([victim, *others])
    # The dead run held the only slot until its lease ran out, and no longer: the next run
    # started after the lease, and everything finished (the slot came back).
    first_after = min(r["started_at"] for r in after)
    waited = (first_after - killed["started_at"]).total_seconds()
    assert waited >= lease - 0.5, f"a run started {waited:.2f}s after the kill, inside the dead run's lease"
    assert max_overlap(after) == 1
    assert worker.alive()


def test_invariant_23_rate_limited_holds_its_type_only_and_spends_no_attempt(harness: Harness) -> None:
    other = "webhook.other"
    retry_after = 3.0
    harness.configure(routes={LIMITED: None, other: None})
    harness.worker(concurrency=2)
    [first] = harness.enqueue(
        1, event_type=LIMITED, payload={"mode": "rate_limited", "retry_after": retry_after}
    )
    harness.wait(
        lambda: [c for c in calls(harness.conn) if c["finished_at"] is not None],
        what="the rate-limited run",
    )
    same = harness.enqueue(4, event_type=LIMITED)
    flowing = harness.enqueue(4, event_type=other)
    harness.wait_finished(9)

    seen = calls(harness.conn)
    limited_at = next(c["finished_at"] for c in seen if c["outbox_id"] == first)
    held = [c for c in seen if c["outbox_id"] in same or (c["outbox_id"] == first and c["n"] != seen[0]["n"])]
    early = [c for c in held if (c["started_at"] - limited_at).total_seconds() < retry_after - 0.5]
    assert not early, "a message of the rate-limited type started before its Retry-After"
    # The other type was not held: it finished well inside the hold.
    assert all(
        (c["started_at"] - limited_at).total_seconds() < retry_after - 0.5
        for c in seen
        if c["outbox_id"] in flowing
    )
    rows = {r["id"]: r for r in harness.rows()}
    assert rows[first]["attempts"] == 1, "the rate-limited run spent an attempt"


def test_invariant_23_pause_from_the_cli_and_resume_from_python_wakes_the_listener(
    harness: Harness,
) -> None:
    other = "webhook.other"
    # No beat, and a listener that polls only every 30 s: only resume's notification can wake it.
    harness.configure(routes={LIMITED: None, other: None}, listen_poll=30.0)
    cli = [sys.executable, "-m", "outbox_celery", "--dsn", harness.dsn, "--table", harness.table]
    paused = subprocess.run([*cli, "pause", LIMITED], capture_output=True, text=True, timeout=60, check=True)
    assert f"paused {LIMITED!r}" in paused.stdout
    harness.worker(concurrency=2)
    held = harness.enqueue(3, event_type=LIMITED)
    flowing = harness.enqueue(3, event_type=other)
    harness.wait_finished(3)
    time.sleep(1.0)
    stats = subprocess.run([*cli, "stats"], capture_output=True, text=True, timeout=60, check=True)
    assert f"paused (claimed by nobody until resumed): {LIMITED}" in stats.stdout
    assert {r["id"] for r in harness.rows() if r["status"] == "done"} == set(flowing)
    assert [
        e.paused for e in ops.stats(harness.conn, harness.table).event_types if e.event_type == LIMITED
    ] == [True]

    resumed_at = time.monotonic()
    assert harness.outbox.resume(LIMITED) is True
    harness.wait_finished(6, timeout=20.0)
    assert time.monotonic() - resumed_at < 15.0
    assert {r["id"] for r in harness.rows() if r["status"] == "done"} == {*held, *flowing}


def test_invariant_22_a_rate_limit_holds_across_workers_within_one_burst(harness: Harness) -> None:
    rate = 5  # per second; the bucket holds max(1, 5 x 0.2) = 1 start
    harness.configure(routes={LIMITED: None}, limits={LIMITED: {"rate": f"{rate}/s"}})
    harness.worker(name="a", concurrency=2)
    harness.worker(name="b", concurrency=2)
    ids = harness.enqueue(16, event_type=LIMITED)
    harness.wait_finished(16)

    starts = sorted(c["started_at"] for c in calls(harness.conn) if c["outbox_id"] in ids)
    assert len(starts) == 16
    span = (starts[-1] - starts[0]).total_seconds()
    # 16 starts at 5/s after a burst of 1: at least 3 s apart end to end (some slack for the
    # hop from claim to start), and not much slower than the rate either.
    assert span >= (16 - 1 - 1) / rate - 0.5, f"16 starts within {span:.2f}s: faster than {rate}/s"
    assert span <= 16 / rate + 3.0
    # Every 1-s window from any start holds at most the rate plus one burst (and one start of
    # jitter between a claim and its start).
    for i, first in enumerate(starts):
        within = [s for s in starts[i:] if (s - first).total_seconds() < 1.0]
        assert len(within) <= rate + 1 + 1, f"{len(within)} starts within 1 s of {first}"
