"""Nothing is lost (DESIGN invariant 10): random outcomes from concurrent workers, then a drain."""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from typing import Any

import psycopg
from support import steps

from outbox_celery import Event, Store, enqueue_many

from .helpers import SHORT, Connect, fetch_all

MAX_ATTEMPTS = 4
OUTCOMES = {
    "done": 40,
    "retry": 15,
    "defer": 6,
    "crash": 6,  # the handler started and its worker died: no finalize
    "error": 6,  # unexpected exception: recorded, the row comes back through its lease
    "permanent": 3,
    "slow": 4,  # the handler outlives its lease, then tries to finish
    "lost_task": 10,  # claimed, the task never reached a worker
    "release": 5,  # the broker refused the task
    "redelivered": 5,  # acks late: the same task runs twice
}


def blocked(rows: list[dict[str, Any]]) -> set[int]:
    """Pending rows behind a dead message of their ordering key: they wait for a human."""
    dead_heads: dict[str, int] = {}
    for r in rows:
        if r["status"] == "dead" and r["ordering_key"] is not None:
            dead_heads.setdefault(r["ordering_key"], r["id"])
    return {
        r["id"]
        for r in rows
        if r["status"] == "pending"
        and r["ordering_key"] in dead_heads
        and r["id"] > dead_heads[r["ordering_key"]]
    }


def unsettled(rows: list[dict[str, Any]]) -> list[int]:
    """Rows that still have to come back and finish."""
    waiting = blocked(rows)
    return [r["id"] for r in rows if r["status"] in ("pending", "processing") and r["id"] not in waiting]


def test_invariant_10_random_outcomes_never_lose_a_row_nor_kill_a_healthy_one(
    conn: psycopg.Connection[Any], store: Store, table: str, connect: Connect
) -> None:
    keys = ["k1", "k2", "k3"]
    events = [Event("e", {"n": n}, "a", n) for n in range(150)]
    events += [Event("e", {"n": n}, "a", n, ordering_key=keys[n % 3]) for n in range(45)]
    with conn.transaction():
        ids = enqueue_many(conn, events, table=table)
    key_of = {i: e.ordering_key for i, e in zip(ids, events, strict=True)}

    lock = threading.Lock()
    done_calls: dict[int, int] = defaultdict(int)
    done_order: list[int] = []
    killed: set[int] = set()
    stale_finishes = 0
    errors: list[BaseException] = []
    stop = threading.Event()
    names, weights = zip(*OUTCOMES.items(), strict=True)

    def finish(c: psycopg.Connection[Any], i: int, version: int, outcome: str, rng: random.Random) -> None:
        nonlocal stale_finishes
        if outcome in ("done", "slow", "redelivered"):
            with lock:
                if steps.done(store, c, i, version):
                    done_calls[i] += 1
                    done_order.append(i)
                else:
                    stale_finishes += 1
        elif outcome == "retry":
            steps.retry(
                store, c, i, version, delay=rng.uniform(0, 0.1), error="503", max_attempts=MAX_ATTEMPTS
            )
        elif outcome == "defer":
            steps.defer(store, c, i, version, delay=0.05, reason="not yet", max_age=3600)
        elif outcome == "error":
            steps.record_error(store, c, i, version, error="RuntimeError")
        elif outcome == "permanent":
            with lock:
                if steps.dead(store, c, i, version, error="PermanentError"):
                    killed.add(i)

    def work(c: psycopg.Connection[Any], rng: random.Random, outcome_of: Any) -> bool:
        claims = steps.claim(store, c, limit=5, lease=SHORT, owner="w", max_attempts=MAX_ATTEMPTS).claimed
        for cl in claims:
            outcome = outcome_of(rng)
            if outcome == "lost_task":
                continue
            if outcome == "release":
                steps.release(store, c, [cl])
                continue
            msg = steps.start(store, c, cl.id, cl.lease_version, lease=SHORT, max_attempts=MAX_ATTEMPTS)
            if msg is None:
                continue
            if outcome == "crash":
                continue
            if outcome == "slow":
                time.sleep(SHORT + 0.1)
            if outcome == "redelivered":
                steps.start(store, c, cl.id, cl.lease_version, lease=SHORT, max_attempts=MAX_ATTEMPTS)
            finish(c, cl.id, cl.lease_version, outcome, rng)
        return bool(claims)

    def worker(n: int) -> None:
        rng = random.Random(1000 + n)
        try:
            c = connect()
            while not stop.is_set():
                if not work(c, rng, lambda r: r.choices(names, weights)[0]):
                    time.sleep(0.01)
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors

    # Drain with healthy workers only: every row must come back and finish.
    drainer = connect()
    rng = random.Random(0)
    deadline = time.monotonic() + 30
    while stuck := unsettled(fetch_all(conn, table)):
        assert time.monotonic() < deadline, f"rows are stuck: {stuck}"
        if not work(drainer, rng, lambda r: "done"):
            time.sleep(0.02)

    final = fetch_all(conn, table)
    waiting = blocked(final)
    rows = {r["id"]: r for r in final}
    assert sorted(rows) == ids
    for i, r in rows.items():
        assert 0 <= r["attempts"] <= MAX_ATTEMPTS
        if i in waiting:
            assert r["status"] == "pending" and done_calls[i] == 0
        elif r["status"] == "done":
            # The fence let exactly one done() win.
            assert done_calls[i] == 1, i
        else:
            assert r["status"] == "dead", r
            assert done_calls[i] == 0, i
            # Dead for a reason: a permanent failure, or every attempt spent.
            assert i in killed or (
                r["attempts"] == MAX_ATTEMPTS and "attempts exhausted" in r["last_error"]
            ), r
    assert killed <= {i for i, r in rows.items() if r["status"] == "dead"}
    # Ordered keys finished in id order.
    for key in keys:
        finished = [i for i in done_order if key_of[i] == key]
        assert finished == sorted(finished)
    # The run really exercised the interesting paths.
    assert sum(1 for r in rows.values() if r["status"] == "done") > 100
    assert stale_finishes + store.get_stats().get("lost_leases", 0) > 0
