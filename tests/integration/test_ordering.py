"""Ordered messages (DESIGN invariant 9): one claimable head per key, finished in id order."""

from __future__ import annotations

import itertools
import random
import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_celery import Event, Store, enqueue_many

from .helpers import LONG, PAST_SHORT, SHORT, Connect, add, claim_ids, count, fetch


def add_interleaved(
    conn: psycopg.Connection[Any], table: str, keys: list[str | None], n: int
) -> dict[str | None, list[int]]:
    """``n`` messages per key, inserted round-robin so that the keys' ids interleave."""
    events = [
        Event(
            event_type="thing.happened",
            payload={"k": k, "j": j},
            aggregate_type="t",
            aggregate_id=j,
            ordering_key=k,
        )
        for j in range(n)
        for k in keys
    ]
    with conn.transaction():
        ids = enqueue_many(conn, events, table=table)
    by_key: dict[str | None, list[int]] = {k: [] for k in keys}
    for event, i in zip(events, ids, strict=True):
        by_key[event.ordering_key].append(i)
    return by_key


def test_invariant_9_only_the_lowest_unfinished_id_of_a_key_is_claimable(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    ids = add(conn, 5, table=table, key="order:1")
    for i in ids:
        [c] = store.claim(conn, limit=10, lease=LONG, owner="w", max_attempts=5).claimed
        assert c.id == i
        assert claim_ids(store, conn, limit=10) == []
        assert store.done(conn, c.id, c.lease_version) is True
    assert count(conn, table, "status = 'done'") == 5


def test_invariant_9_concurrent_claimers_never_hold_two_messages_of_one_key(
    conn: psycopg.Connection[Any], store: Store, table: str, connect: Connect
) -> None:
    keys: list[str | None] = [f"key{k}" for k in range(50)]
    by_key = add_interleaved(conn, table, keys, 4)
    workers = 4
    barrier = threading.Barrier(workers)
    got: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            c = connect()
            barrier.wait(timeout=10)
            for _ in range(5):
                ids = claim_ids(store, c, limit=9)
                with lock:
                    got.extend(ids)
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert sorted(got) == sorted(ids[0] for ids in by_key.values())
    rows = conn.execute(
        sql.SQL(
            "SELECT ordering_key, array_agg(id ORDER BY id) FROM {} WHERE status = 'processing' GROUP BY 1"
        ).format(store.table.identifier())
    ).fetchall()
    assert {k: v for k, v in rows} == {k: [ids[0]] for k, ids in by_key.items()}


def test_invariant_9_concurrent_workers_finish_each_key_in_id_order_while_keys_interleave(
    conn: psycopg.Connection[Any], store: Store, table: str, connect: Connect
) -> None:
    keys: list[str | None] = ["customer:A", "customer:B", None]
    by_key = add_interleaved(conn, table, keys, 30)
    total = sum(len(v) for v in by_key.values())
    order: list[tuple[str | None, int]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    deadline = time.monotonic() + 30

    def worker(n: int) -> None:
        rng = random.Random(n)
        try:
            c = connect()
            while time.monotonic() < deadline:
                with lock:
                    if len(order) == total:
                        return
                claims = store.claim(c, limit=3, lease=LONG, owner=f"w{n}", max_attempts=5).claimed
                if not claims:
                    time.sleep(0.002)
                    continue
                for cl in claims:
                    msg = store.start(c, cl.id, cl.lease_version, lease=LONG, max_attempts=5)
                    assert msg is not None
                    time.sleep(rng.uniform(0, 0.004))  # the handler
                    # Recording under the lock keeps `order` the order of successful done()s.
                    with lock:
                        assert store.done(c, cl.id, cl.lease_version) is True
                        order.append((msg.ordering_key, msg.id))
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=40)
    assert not errors
    assert len(order) == total, "some messages never finished"
    for key in ("customer:A", "customer:B"):
        assert [i for k, i in order if k == key] == by_key[key]
    # The keys progress independently: their completions interleave instead of one key
    # waiting for the other to drain.
    ordered_keys = [k for k, _ in order if k is not None]
    switches = sum(1 for a, b in itertools.pairwise(ordered_keys) if a != b)
    assert switches >= 10, ordered_keys
    assert count(conn, table, "status = 'done'") == total


def test_invariant_9_a_slow_head_does_not_hold_up_other_keys(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    by_key = add_interleaved(conn, table, ["A", "B"], 3)
    claims = {c.id: c for c in store.claim(conn, limit=10, lease=LONG, owner="w", max_attempts=5).claimed}
    assert sorted(claims) == [by_key["A"][0], by_key["B"][0]]
    # A's head is still running; B moves on twice.
    for j in (0, 1):
        b = claims.pop(by_key["B"][j])
        assert store.done(conn, b.id, b.lease_version) is True
        [nxt] = store.claim(conn, limit=10, lease=LONG, owner="w", max_attempts=5).claimed
        assert nxt.id == by_key["B"][j + 1]
        claims[nxt.id] = nxt
    assert fetch(conn, table, by_key["A"][1])["status"] == "pending"


def test_invariant_9_a_dead_head_blocks_only_its_key(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    by_key = add_interleaved(conn, table, ["A", "B", None], 3)
    a, b, u = by_key["A"], by_key["B"], by_key[None]
    first = {c.id: c for c in store.claim(conn, limit=10, lease=LONG, owner="w", max_attempts=5).claimed}
    assert sorted(first) == sorted([a[0], b[0], *u])
    assert store.dead(conn, a[0], first.pop(a[0]).lease_version, error="HTTP 400") is True
    for c in first.values():
        assert store.done(conn, c.id, c.lease_version) is True
    # B's next message and brand-new work are claimable; A's tail is not.
    [c_new] = add(conn, table=table, key="C")
    [u_new] = add(conn, table=table)
    assert sorted(claim_ids(store, conn, limit=10)) == sorted([b[1], c_new, u_new])
    for i in (b[1], c_new, u_new):
        assert store.done(conn, i, 1) is True
    assert claim_ids(store, conn, limit=10) == [b[2]]
    assert store.done(conn, b[2], 1) is True
    assert claim_ids(store, conn, limit=10) == []
    for i in a[1:]:
        row = fetch(conn, table, i)
        assert (row["status"], row["lease_version"]) == ("pending", 0)


@pytest.mark.parametrize("outcome", ["retry", "defer", "postpone"])
def test_invariant_9_a_head_sent_back_to_pending_keeps_its_key_waiting(
    conn: psycopg.Connection[Any], store: Store, table: str, outcome: str
) -> None:
    a = add(conn, 2, table=table, key="A")
    [c] = store.claim(conn, limit=10, lease=LONG, owner="w", max_attempts=5).claimed
    assert c.id == a[0]
    assert store.start(conn, c.id, c.lease_version, lease=LONG, max_attempts=5) is not None
    if outcome == "retry":
        assert store.retry(conn, c.id, c.lease_version, delay=SHORT, error="503", max_attempts=5) == "pending"
    elif outcome == "defer":
        assert store.defer(conn, c.id, c.lease_version, delay=SHORT, reason="x", max_age=60) == "pending"
    else:
        assert store.postpone(conn, c.id, c.lease_version, delay=SHORT, error="no handler") is True
    # The head may come back once its delay is over; its successor never before it is done.
    got = claim_ids(store, conn, limit=10)
    assert a[1] not in got
    time.sleep(PAST_SHORT)
    got += claim_ids(store, conn, limit=10)
    assert got == [a[0]]
    assert fetch(conn, table, a[1])["status"] == "pending"
    assert store.done(conn, a[0], 2) is True
    assert claim_ids(store, conn, limit=10) == [a[1]]


def test_invariant_9_an_expired_or_released_head_comes_back_before_its_successor(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    a = add(conn, 2, table=table, key="A")
    assert claim_ids(store, conn, lease=SHORT) == [a[0]]
    # Its worker starts it and dies (a claim that never started waits out a delay instead).
    assert store.start(conn, a[0], 1, lease=SHORT, max_attempts=5) is not None
    time.sleep(PAST_SHORT)
    claims = store.claim(conn, limit=10, lease=LONG, owner="w", max_attempts=5).claimed
    assert [(c.id, c.lease_version) for c in claims] == [(a[0], 2)]
    assert store.release(conn, claims) == 1
    assert claim_ids(store, conn) == [a[0]]
    assert fetch(conn, table, a[1])["lease_version"] == 0


def test_invariant_9_ordered_heads_and_unordered_rows_share_a_batch(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    by_key = add_interleaved(conn, table, [f"k{n}" for n in range(10)], 1)
    unordered = add(conn, 10, table=table)
    got = claim_ids(store, conn, limit=4)
    assert len(got) == 4
    heads = {ids[0] for ids in by_key.values()}
    assert any(i in heads for i in got)
    assert any(i in unordered for i in got)
    # Once unordered rows run out, heads fill the batch.
    rest = claim_ids(store, conn, limit=100)
    assert sorted(got + rest) == sorted(heads | set(unordered))
