"""Batch handlers in real workers (DESIGN invariant 21), made to happen.

* A mixed batch: one task, one handler call for every message; each message's outcome (done,
  retried then done, deferred, dead) is recorded for it alone.
* A worker SIGKILLed mid-batch: the task was acknowledged, every row of the batch is still
  ``processing`` under a started claim; after the lease the claim takes them all again and they
  are delivered once more. Nothing lost.
* Stale pairs: a batch task that carries a claim superseded since (its lease ran out, the row
  was claimed again) drops that pair; the handler sees the others, the newer claim delivers it.
* Ordered messages of a batch handler: at most one per key per batch, never inverted.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, defaultdict
from typing import Any

import pytest
from psycopg import sql
from support import steps
from support.db import calls, statuses

from acceptance.conftest import Harness, HarnessFactory
from outbox_celery import TableName

pytestmark = pytest.mark.slow

EVENT = "metrics.sample"
LEASE = 6.0


def _batched(harness: Harness, size: int = 10, **outbox: Any) -> None:
    harness.configure(routes={}, batches={EVENT: size}, **outbox)


def test_invariant_21_a_mixed_batch_records_each_outcome_for_its_own_message(harness: Harness) -> None:
    _batched(harness)
    modes: list[dict[str, Any]] = [
        {"mode": "ok"},
        {"mode": "retry", "times": 1},
        {"mode": "defer", "delay": 3600},
        {"mode": "permanent"},
        {"mode": "ok"},
    ]
    ids = harness.enqueue(len(modes), event_type=EVENT, payload=lambda i: modes[i])
    worker = harness.worker(concurrency=1)
    harness.beat()
    # Done: the two ok and the retried one (its second run); dead: the permanent one.
    harness.wait_finished(4, statuses_=("done", "dead"))
    rows = {r["id"]: r for r in harness.rows()}
    ok, retried, deferred, dead, ok2 = ids
    assert [rows[i]["status"] for i in ids] == ["done", "done", "pending", "dead", "done"]
    assert (rows[retried]["attempts"], rows[deferred]["attempts"], rows[dead]["attempts"]) == (2, 0, 1)
    assert rows[deferred]["available_in"] > 3000
    runs = calls(harness.conn)
    # The first run: every message in one batch of five, one handler call.
    first = [c for c in runs if c["batch_size"] == len(ids)]
    assert [c["outbox_id"] for c in first] == ids
    assert {c["batch_first"] for c in first} == {ok}
    # The retry came back on its own: a batch of one.
    assert [(c["outbox_id"], c["batch_size"]) for c in runs if c not in first] == [(retried, 1)]
    # One task per batch, its size in the name Flower and the worker's log show.
    assert f"deliver_batch[{EVENT}][5]" in worker.log()
    assert Counter(c["outbox_id"] for c in runs) == {ok: 1, retried: 2, deferred: 1, dead: 1, ok2: 1}


def test_invariant_21_a_worker_killed_mid_batch_loses_nothing(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    harness = harness_factory(redis_url)
    _batched(harness, lease=LEASE)
    # The second message keeps the batch in its handler while the worker is killed.
    ids = harness.enqueue(
        4, event_type=EVENT, payload=lambda i: {"mode": "sleep", "seconds": 30, "times": 1} if i == 1 else {}
    )
    worker = harness.worker(concurrency=1)
    harness.beat()
    harness.wait(lambda: len(calls(harness.conn)) >= 2, what="the batch to reach its second message")
    worker.kill()
    assert statuses(harness.conn, harness.table) == {"processing": len(ids)}
    lease_end = harness.conn.execute(
        sql.SQL("SELECT max(lease_until) FROM {}").format(TableName.parse(harness.table).identifier())
    ).fetchone()
    assert lease_end is not None

    harness.worker(concurrency=1, name="after")
    harness.wait_finished(len(ids), timeout=LEASE + 60)
    rows = harness.rows()
    assert {r["status"] for r in rows} == {"done"}
    assert all((r["attempts"], r["lease_version"]) == (2, 2) for r in rows)
    runs = calls(harness.conn)
    second = [c for c in runs if c["lease_version"] == 2]
    assert sorted(c["outbox_id"] for c in second) == ids
    assert {c["batch_size"] for c in second} == {len(ids)}
    # Back only after the lease the killed run held (the database's clock), every row of the batch.
    assert min(c["started_at"] for c in second) >= lease_end[0]


def test_invariant_21_a_stale_pair_is_dropped_from_its_batch(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    harness = harness_factory(redis_url)
    _batched(harness, lease=3.0, claim_interval=0.3)
    a, b, c = harness.enqueue(3, event_type=EVENT)
    outbox = harness.outbox
    # The first claim sends one batch task of three (a, b, c at version 1); no worker yet.
    assert outbox.claim().published == 3
    # b and c keep their lease (a heartbeat would); a's runs out, unstarted: the claim gives it
    # back and, a first loss (invariant 16), claims it again at version 2 in the same run.
    with outbox.connection() as conn:
        for i in (b, c):
            assert steps.extend_lease(outbox.store, conn, i, 1, seconds=120)
    runs: list[Any] = []
    harness.wait(
        lambda: runs.append(outbox.claim()) or runs[-1].lost == 1, timeout=20, what="a's lease to run out"
    )
    assert runs[-1].published == 1
    assert {r["id"]: r["lease_version"] for r in harness.rows()} == {a: 2, b: 1, c: 1}

    worker = harness.worker(concurrency=1)
    harness.wait_finished(3)
    runs = calls(harness.conn)
    # The old task ran b and c only; a ran once, from its newer claim.
    assert sorted((r["outbox_id"], r["lease_version"], r["batch_size"]) for r in runs) == [
        (a, 2, 1),
        (b, 1, 2),
        (c, 1, 2),
    ]
    assert all(r["attempts"] == 1 for r in harness.rows())
    worker.wait_for_log(f"outbox id {a} version 1 is stale or exhausted")


def test_invariant_21_ordered_messages_in_batches_are_never_inverted(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    harness = harness_factory(redis_url)
    _batched(harness)
    keys = ("k1", "k2", "k3")
    ids = {k: harness.enqueue(4, event_type=EVENT, ordering_key=k) for k in keys}
    harness.worker(concurrency=2)
    harness.worker(concurrency=2, name="second")
    harness.beat()
    harness.wait_finished(12)
    runs = calls(harness.conn)
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    key_of = {i: k for k, group in ids.items() for i in group}
    for run in runs:
        by_key[key_of[run["outbox_id"]]].append(run)
    for key, group in by_key.items():
        assert [r["outbox_id"] for r in group] == ids[key], key
        # Each one began after the previous one of its key had finished.
        for before, after in itertools.pairwise(group):
            assert before["finished_at"] <= after["started_at"], key
    # At most one message of a key in any batch (each message ran once: its first id names it).
    per_batch = Counter((r["batch_first"], key_of[r["outbox_id"]]) for r in runs)
    assert max(per_batch.values()) == 1


def test_max_wait_fills_batches_of_a_low_rate_stream_without_holding_a_row_much_longer(
    harness: Harness,
) -> None:
    # 20 messages a second, one per transaction: without max_wait each producer's commit wakes
    # the listener, whose claim finds that one row (a batch of one). With max_wait 0.5 s the
    # rows wait for each other, up to 0.5 s after the oldest became due (database clock).
    max_wait, rate, seconds = 0.5, 20.0, 3.0
    harness.configure(routes={}, batches={EVENT: 50}, limits={EVENT: {"max_wait": max_wait}})
    harness.worker(concurrency=1)
    harness.beat()
    harness.enqueue(1, event_type=EVENT)
    harness.wait_finished(1)  # the worker and its listener are up
    ids: list[int] = []
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        ids += harness.enqueue(1, event_type=EVENT)
        time.sleep(1 / rate)
    harness.wait_finished(len(ids) + 1)
    runs = [c for c in calls(harness.conn) if c["outbox_id"] in set(ids)]
    assert sorted(c["outbox_id"] for c in runs) == ids
    sizes = [c["batch_size"] for c in runs if c["outbox_id"] == c["batch_first"]]
    # Fuller batches: about rate x max_wait = 10 each; asked generously (a shared machine).
    assert sum(sizes) == len(ids)
    assert len(sizes) <= len(ids) / 3, sizes
    query = sql.SQL(
        "SELECT extract(epoch FROM c.started_at - o.created_at)::float8"
        " FROM handler_calls c JOIN {} o ON o.id = c.outbox_id WHERE c.outbox_id = ANY(%s)"
    ).format(TableName.parse(harness.table).identifier())
    waits = [float(w) for (w,) in harness.conn.execute(query, [ids]).fetchall()]
    # No row waits much beyond max_wait: the claim comes back when the oldest has waited it.
    # A generous bound (claim, broker hop and a loaded machine on top), not a timing claim.
    assert max(waits) < max_wait + 2.5, sorted(waits)[-5:]
