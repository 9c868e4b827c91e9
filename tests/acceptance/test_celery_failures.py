"""Crashes, stalls, poison messages and broker outages, made to happen (invariants 4, 5, 10, 12).

Workers are SIGKILLed from inside a handler, outlive their lease, or lose their broker; every
test then checks that nothing was lost, no healthy message went dead, attempts count only
handler runs, and a stale worker's finalize changed nothing.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import pytest
from support.brokers import RedisServer
from support.db import calls, signals, statuses

from acceptance.conftest import Harness, HarnessFactory
from outbox_celery.claim.claimer import ClaimRun, StoppedBy
from outbox_celery.testing import free_port

pytestmark = pytest.mark.slow


def test_a_worker_process_killed_inside_a_handler_loses_nothing(harness: Harness) -> None:
    harness.configure(lease=3.0, max_attempts=5)
    worker = harness.worker(concurrency=2)

    def both_pool_processes() -> list[int] | None:
        # "ready." can be logged before /proc shows the second pool process.
        pids = worker.pool_pids()
        return pids if len(pids) == 2 else None

    # The pool is seen before anything is enqueued: the worker claims on its own (push), so a
    # victim enqueued earlier can be killed, and its process replaced, before the pool is read.
    pool_before = harness.wait(both_pool_processes, what="both pool processes")
    [victim] = harness.enqueue(1, payload={"mode": "kill", "times": 1})
    others = harness.enqueue(6)
    harness.beat()
    harness.wait_finished(7)

    rows = {r["id"]: r for r in harness.rows()}
    # Re-claimed after its lease (a new fencing token) and delivered by a fresh pool process.
    assert (rows[victim]["status"], rows[victim]["attempts"], rows[victim]["lease_version"]) == ("done", 2, 2)
    runs = [c for c in calls(harness.conn) if c["outbox_id"] == victim]
    assert [(c["attempts"], c["lease_version"]) for c in runs] == [(1, 1), (2, 2)]
    assert runs[0]["finished_at"] is None  # it died inside the handler
    assert runs[1]["result"] == "ok"
    assert runs[0]["pid"] != runs[1]["pid"]
    assert all(rows[i]["attempts"] == 1 for i in others)
    # The pool process that ran attempt 1 is gone; the worker replaced it and lives on.
    assert runs[0]["pid"] in set(pool_before)
    assert runs[0]["pid"] not in worker.pool_pids()
    assert not Path(f"/proc/{runs[0]['pid']}").exists()
    assert worker.alive()


def test_a_stalled_worker_late_finalize_is_fenced(harness: Harness) -> None:
    """Invariant 4: a worker that outlives its lease finalizes nothing (solo: no time limit)."""
    harness.configure(lease=2.0)
    stalled = harness.worker([harness.default_queue], name="stalled", pool="solo")
    [i] = harness.enqueue(1, payload={"mode": "stall", "times": 1})
    # This test claims in-process, so which worker receives which version is under control.
    assert harness.outbox.claim().published == 1
    harness.wait(lambda: calls(harness.conn), what="the stalled worker to start the handler")
    rescuer = harness.worker([harness.default_queue], name="rescuer", concurrency=1)
    harness.wait(lambda: harness.outbox.claim().published == 1, what="a re-claim once the lease ran out")
    harness.wait_finished(1)
    stalled.wait_for_log(f"lost lease: finish_done of outbox id {i} version 1 changed nothing", timeout=60)
    stalled.wait_for_log(f"outbox id {i} thing.happened -> lost_lease", timeout=10)

    [r] = harness.rows()
    assert (r["status"], r["attempts"], r["lease_version"]) == ("done", 2, 2)
    first, second = calls(harness.conn)
    assert (first["lease_version"], first["hostname"].split("@")[0]) == (1, "stalled")
    assert first["result"] == "stalled past a newer run"
    assert (second["lease_version"], second["hostname"].split("@")[0]) == (2, "rescuer")
    assert second["result"] == "ok"
    assert first["finished_at"] > second["finished_at"]
    assert "lost lease" not in rescuer.log()


def test_a_poison_message_that_kills_its_worker_ends_dead_at_max_attempts(harness: Harness) -> None:
    """Invariant 5: every run kills the pool process; attempts count the runs; dead at max."""
    harness.configure(lease=2.0, max_attempts=3)
    [poison] = harness.enqueue(1, payload={"mode": "kill"})
    healthy = harness.enqueue(5)
    worker = harness.worker(concurrency=2)
    harness.beat()
    harness.wait(
        lambda: statuses(harness.conn, harness.table) == {"done": 5, "dead": 1},
        what="the poison message to go dead",
    )
    rows = {r["id"]: r for r in harness.rows()}
    assert (rows[poison]["attempts"], rows[poison]["lease_version"]) == (3, 3)
    assert "attempts exhausted" in rows[poison]["last_error"]
    assert rows[poison]["lease_until"] is None
    runs = [c for c in calls(harness.conn) if c["outbox_id"] == poison]
    assert [(c["attempts"], c["lease_version"]) for c in runs] == [(1, 1), (2, 2), (3, 3)]
    assert all(c["finished_at"] is None for c in runs)
    assert all(rows[i]["status"] == "done" and rows[i]["attempts"] == 1 for i in healthy)
    assert worker.alive()


def test_invariant_31_a_plain_exception_is_a_failed_attempt_retried_after_the_backoff(
    harness_factory: HarnessFactory, broker_url: str
) -> None:
    """A handler that always raises ValueError reaches the dead letters after its attempts and
    their backoffs, not one lease per attempt; each failure is recorded at once and each task
    fails in Celery."""
    harness = harness_factory(broker_url)
    harness.configure(lease=60.0, max_attempts=3, backoff_base=0.2, backoff_cap=1.0)
    [broken] = harness.enqueue(1, payload={"mode": "error"})
    harness.worker()
    harness.beat()
    started = time.monotonic()
    harness.wait(lambda: statuses(harness.conn, harness.table) == {"dead": 1}, what="the row to go dead")
    assert time.monotonic() - started < 30  # three leases would be 180 s
    [row] = harness.rows()
    assert (row["attempts"], row["lease_version"]) == (3, 3)
    assert row["last_error"].startswith(
        "attempts exhausted (3 of 3): RuntimeError: scripted unexpected error"
    )
    assert "lease expired" not in row["last_error"]
    runs = [c for c in calls(harness.conn) if c["outbox_id"] == broken]
    assert [(c["attempts"], c["lease_version"]) for c in runs] == [(1, 1), (2, 2), (3, 3)]
    # The third task's failure signal fires after its fenced write made the row dead: wait for it.
    harness.wait(lambda: len(signals(harness.conn, "task_failure")) >= 3, what="three task failures")
    failures = signals(harness.conn, "task_failure")
    assert len(failures) == 3 and all("scripted unexpected error" in f["detail"] for f in failures)


def _with_port(url: str, port: int) -> str:
    parsed = urlparse(url)
    netloc = parsed.netloc.rsplit("@", 1)
    host = f"127.0.0.1:{port}"
    return urlunparse(parsed._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))


def test_a_broker_that_refuses_the_publish_costs_no_attempt_and_no_lease(
    broker_url: str, harness_factory: HarnessFactory
) -> None:
    """Invariant 12: claimed rows the broker refused are pending again at once, attempts 0."""
    refused = harness_factory(_with_port(broker_url, free_port()))
    ids = refused.enqueue(5)
    run = refused.outbox.claim()
    assert (run.claimed, run.published, run.released, run.stopped_by) == (5, 0, 5, "publish_failed")
    rows = refused.rows()
    assert [r["id"] for r in rows] == ids
    assert all(r["status"] == "pending" and r["attempts"] == 0 for r in rows)
    assert all(r["lease_version"] == 1 and r["lease_until"] is None for r in rows)
    assert all(r["available_in"] <= 0 for r in rows)
    # No lease to wait out: a claim through a working broker takes them right away.
    live = harness_factory(broker_url)
    run = live.outbox.claim()
    assert (run.claimed, run.published, run.released) == (5, 5, 0)
    assert all(r["lease_version"] == 2 and r["attempts"] == 0 for r in live.rows())


def test_a_redis_outage_mid_run_loses_nothing_and_burns_no_attempt(
    harness_factory: HarnessFactory, tmp_path: Path
) -> None:
    """Invariant 10: the broker crashes while beat and workers run, then comes back empty."""
    with RedisServer(tmp_path / "redis", free_port()) as redis:
        h = harness_factory(redis.url)
        # listen=False: the manual claim below must not race the worker's push listener
        # for the rows committed during the outage.
        h.configure(lease=3.0, max_attempts=4, listen=False)
        first = h.enqueue(30)
        h.worker(concurrency=2)
        h.beat()
        h.wait_finished(10)
        with h.app.producer_or_acquire():
            pass  # the in-process app now holds a pooled connection to this Redis

        redis.crash()  # whatever was queued or reserved is gone with it
        during = h.enqueue(5)  # producers keep writing

        def a_run_of_its_own() -> ClaimRun | None:
            # A worker's claim run (beat's claim task) may be in its claim transaction, which
            # holds the claim lock: this one then stops at once (another_claim_running) and is
            # asked again.
            run = h.outbox.claim()
            return None if run.stopped_by is StoppedBy.ANOTHER_CLAIM_RUNNING else run

        run: ClaimRun = h.wait(a_run_of_its_own, timeout=30.0, what="a claim run beside beat's")
        assert run.claimed >= 5 and run.published == 0 and run.released == run.claimed
        for r in h.rows():
            if r["id"] in during:
                assert (r["status"], r["attempts"], r["lease_until"]) == ("pending", 0, None)
        time.sleep(2.0)
        assert statuses(h.conn, h.table)["dead"] == 0

        redis.start()
        # A worker that failed to ack while Redis was gone may never consume again (an upstream
        # Celery/kombu issue, celery/celery#9054): a fresh one stands in, as a supervisor's
        # restart would. Nothing in the outbox depends on which worker survives.
        h.worker(name="w2", concurrency=2)
        h.wait_finished(35)
        rows = h.rows()
        assert [r["id"] for r in rows] == first + during
        assert {r["status"] for r in rows} == {"done"}
        # Attempts count handler runs only: tasks lost with the broker spent none.
        runs = Counter(c["outbox_id"] for c in calls(h.conn))
        assert all(r["attempts"] == runs[r["id"]] for r in rows)
        h.close()  # while Redis still runs
