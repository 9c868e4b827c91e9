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
from support import steps

from outbox_celery import Event, ProducerError, Store, TableName, enqueue, enqueue_many, ops

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
        [c] = steps.claim(store, conn, limit=10, lease=LONG, owner="w", max_attempts=5).claimed
        assert c.id == i
        assert claim_ids(store, conn, limit=10) == []
        assert steps.done(store, conn, c.id, c.lease_version).applied
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
                claims = steps.claim(store, c, limit=3, lease=LONG, owner=f"w{n}", max_attempts=5).claimed
                if not claims:
                    time.sleep(0.002)
                    continue
                for cl in claims:
                    msg = steps.start(store, c, cl.id, cl.lease_version, lease=LONG, max_attempts=5)
                    assert msg is not None
                    time.sleep(rng.uniform(0, 0.004))  # the handler
                    # Recording under the lock keeps `order` the order of successful done()s.
                    with lock:
                        assert steps.done(store, c, cl.id, cl.lease_version).applied
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
    claims = {
        c.id: c for c in steps.claim(store, conn, limit=10, lease=LONG, owner="w", max_attempts=5).claimed
    }
    assert sorted(claims) == [by_key["A"][0], by_key["B"][0]]
    # A's head is still running; B moves on twice.
    for j in (0, 1):
        b = claims.pop(by_key["B"][j])
        assert steps.done(store, conn, b.id, b.lease_version).applied
        [nxt] = steps.claim(store, conn, limit=10, lease=LONG, owner="w", max_attempts=5).claimed
        assert nxt.id == by_key["B"][j + 1]
        claims[nxt.id] = nxt
    assert fetch(conn, table, by_key["A"][1])["status"] == "pending"


def test_invariant_9_a_dead_head_blocks_only_its_key(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    by_key = add_interleaved(conn, table, ["A", "B", None], 3)
    a, b, u = by_key["A"], by_key["B"], by_key[None]
    first = {
        c.id: c for c in steps.claim(store, conn, limit=10, lease=LONG, owner="w", max_attempts=5).claimed
    }
    assert sorted(first) == sorted([a[0], b[0], *u])
    assert steps.dead(store, conn, a[0], first.pop(a[0]).lease_version, error="HTTP 400").applied
    for c in first.values():
        assert steps.done(store, conn, c.id, c.lease_version).applied
    # B's next message and brand-new work are claimable; A's tail is not.
    [c_new] = add(conn, table=table, key="C")
    [u_new] = add(conn, table=table)
    assert sorted(claim_ids(store, conn, limit=10)) == sorted([b[1], c_new, u_new])
    for i in (b[1], c_new, u_new):
        assert steps.done(store, conn, i, 1).applied
    assert claim_ids(store, conn, limit=10) == [b[2]]
    assert steps.done(store, conn, b[2], 1).applied
    assert claim_ids(store, conn, limit=10) == []
    for i in a[1:]:
        row = fetch(conn, table, i)
        assert (row["status"], row["lease_version"]) == ("pending", 0)


@pytest.mark.parametrize("outcome", ["retry", "defer", "postpone"])
def test_invariant_9_a_head_sent_back_to_pending_keeps_its_key_waiting(
    conn: psycopg.Connection[Any], store: Store, table: str, outcome: str
) -> None:
    a = add(conn, 2, table=table, key="A")
    [c] = steps.claim(store, conn, limit=10, lease=LONG, owner="w", max_attempts=5).claimed
    assert c.id == a[0]
    assert steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5) is not None
    if outcome == "retry":
        assert (
            steps.retry(store, conn, c.id, c.lease_version, delay=SHORT, error="503", max_attempts=5).status
            == "pending"
        )
    elif outcome == "defer":
        assert (
            steps.defer(store, conn, c.id, c.lease_version, delay=SHORT, reason="x", max_age=60).status
            == "pending"
        )
    else:
        assert steps.postpone(store, conn, c.id, c.lease_version, delay=SHORT, error="no handler").applied
    # The head may come back once its delay is over; its successor never before it is done.
    got = claim_ids(store, conn, limit=10)
    assert a[1] not in got
    time.sleep(PAST_SHORT)
    got += claim_ids(store, conn, limit=10)
    assert got == [a[0]]
    assert fetch(conn, table, a[1])["status"] == "pending"
    assert steps.done(store, conn, a[0], 2).applied
    assert claim_ids(store, conn, limit=10) == [a[1]]


def test_invariant_9_an_expired_or_released_head_comes_back_before_its_successor(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    a = add(conn, 2, table=table, key="A")
    assert claim_ids(store, conn, lease=SHORT) == [a[0]]
    # Its worker starts it and dies (a claim that never started waits out a delay instead).
    assert steps.start(store, conn, a[0], 1, lease=SHORT, max_attempts=5) is not None
    time.sleep(PAST_SHORT)
    claims = steps.claim(store, conn, limit=10, lease=LONG, owner="w", max_attempts=5).claimed
    assert [(c.id, c.lease_version) for c in claims] == [(a[0], 2)]
    assert steps.release(store, conn, claims) == 1
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


# -- explicit heads (invariants 9 and 17): every race that could lose or double a head --------


def heads_consistent(conn: psycopg.Connection[Any], table: str) -> None:
    """Every key with unfinished messages has exactly one head among them: the lowest id."""
    rows = conn.execute(
        sql.SQL(
            "SELECT ordering_key, min(id), array_agg(id ORDER BY id) FILTER (WHERE head)"
            " FROM {} WHERE ordering_key IS NOT NULL AND status <> 'done' GROUP BY 1"
        ).format(TableName.parse(table).identifier())
    ).fetchall()
    assert [(k, [lowest]) for k, lowest, _ in rows] == [(k, flagged) for k, _, flagged in rows]


def wait_for_advisory_waiter(conn: psycopg.Connection[Any], timeout: float = 3) -> None:
    """Return once some session waits for an advisory lock (a key lock held elsewhere).

    Bounded, and silent on timeout: the test's own assertions then say what went wrong.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # pg_locks is cluster-wide: only this database's sessions count.
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
        if row and row[0]:
            return
        time.sleep(0.02)


def test_invariant_9_enqueue_many_with_several_messages_of_one_key_flags_only_the_first(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [old_a] = add(conn, table=table, key="A")
    events = [
        Event("e", {"n": n}, "t", n, ordering_key=k) for n, k in enumerate(["A", "B", "A", None, "B", "C"])
    ]
    with conn.transaction():
        ids = enqueue_many(conn, events, table=table)
    heads_consistent(conn, table)
    # A already had an unfinished message: none of the batch is its head.
    assert sorted(claim_ids(store, conn)) == sorted([old_a, ids[1], ids[3], ids[5]])
    for i in (old_a, ids[1], ids[3], ids[5]):
        assert steps.done(store, conn, i, 1).applied
    heads_consistent(conn, table)
    assert sorted(claim_ids(store, conn)) == sorted([ids[0], ids[4]])


def test_invariant_9_a_producer_committing_while_the_head_finishes_is_never_missed(
    conn: psycopg.Connection[Any], store: Store, table: str, connect: Connect
) -> None:
    # The producer holds the key lock with its message uncommitted; the head's done must wait
    # for it, then hand the key to that message.
    [a0] = add(conn, table=table, key="A")
    [c] = steps.claim(store, conn, limit=10, lease=LONG, owner="w", max_attempts=5).claimed
    producer = connect()
    with producer.transaction():
        [a1] = enqueue_many(producer, [Event("e", {}, "t", 1, ordering_key="A")], table=table)
        result: dict[str, bool] = {}
        worker = threading.Thread(
            target=lambda: result.update(won=steps.done(store, connect(), c.id, c.lease_version).applied)
        )
        worker.start()
        wait_for_advisory_waiter(conn)
    worker.join(timeout=10)
    assert result == {"won": True}
    heads_consistent(conn, table)
    assert claim_ids(store, conn) == [a1]
    assert a0 < a1


def test_invariant_9_a_producer_waiting_while_the_head_finishes_sees_it_done(
    conn: psycopg.Connection[Any], store: Store, table: str, connect: Connect
) -> None:
    # The reverse order: the head's done holds the key lock uncommitted; the producer waits for
    # it and its message becomes the key's head.
    add(conn, table=table, key="A")
    [c] = steps.claim(store, conn, limit=10, lease=LONG, owner="w", max_attempts=5).claimed
    worker = connect()
    got: list[int] = []
    with worker.transaction():
        assert steps.done(store, worker, c.id, c.lease_version).applied
        producer = threading.Thread(target=lambda: got.extend(add(connect(), table=table, key="A")))
        producer.start()
        wait_for_advisory_waiter(conn)
    producer.join(timeout=10)
    assert len(got) == 1
    heads_consistent(conn, table)
    assert claim_ids(store, conn) == got


def test_invariant_9_skipping_a_dead_head_while_a_producer_commits_hands_over_the_key(
    conn: psycopg.Connection[Any], store: Store, table: str, connect: Connect
) -> None:
    [a0] = add(conn, table=table, key="A")
    [c] = steps.claim(store, conn, limit=10, lease=LONG, owner="w", max_attempts=5).claimed
    assert steps.dead(store, conn, c.id, c.lease_version, error="HTTP 400").applied
    operator = connect()
    got: list[int] = []
    with operator.transaction():
        assert ops.skip(operator, table, [a0], reason="customer deleted") == [a0]
        producer = threading.Thread(target=lambda: got.extend(add(connect(), table=table, key="A")))
        producer.start()
        wait_for_advisory_waiter(conn)
    producer.join(timeout=10)
    heads_consistent(conn, table)
    assert claim_ids(store, conn) == got


def test_invariant_9_skip_and_requeue_move_or_keep_the_head_as_the_key_needs(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    a = add(conn, 5, table=table, key="A")
    [c] = steps.claim(store, conn, limit=10, lease=LONG, owner="w", max_attempts=5).claimed
    # A pending message behind a processing head is skipped: the head stays where it is.
    assert ops.skip(conn, table, [a[1]], reason="obsolete") == [a[1]]
    heads_consistent(conn, table)
    assert claim_ids(store, conn) == []
    assert steps.dead(store, conn, c.id, c.lease_version, error="HTTP 400").applied
    assert claim_ids(store, conn) == []
    # Requeued, the dead head is the head again, ahead of everything behind it.
    assert ops.requeue(conn, table, [a[0]]) == [a[0]]
    heads_consistent(conn, table)
    [c] = steps.claim(store, conn, limit=10, lease=LONG, owner="w", max_attempts=5).claimed
    assert c.id == a[0]
    assert steps.dead(store, conn, c.id, c.lease_version, error="HTTP 400").applied
    # The dead head and the message after it skipped together: the next one is the head.
    assert ops.skip(conn, table, [a[0], a[2]], reason="obsolete") == [a[0], a[2]]
    heads_consistent(conn, table)
    assert claim_ids(store, conn) == [a[3]]
    assert steps.done(store, conn, a[3], 1).applied
    assert claim_ids(store, conn) == [a[4]]


def test_invariant_9_done_rows_purged_never_disturb_the_heads(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    a = add(conn, 2, table=table, key="A")
    assert steps.done(store, conn, claim_ids(store, conn)[0], 1).applied
    assert ops.purge_done(conn, table, older_than=0, batch_size=100) == 1
    [a2] = add(conn, table=table, key="A")
    heads_consistent(conn, table)
    assert claim_ids(store, conn) == [a[1]]
    assert steps.done(store, conn, a[1], 1).applied
    assert claim_ids(store, conn) == [a2]


def test_invariant_9_ordered_enqueue_refuses_a_snapshot_older_than_its_key_lock(
    conn: psycopg.Connection[Any], store: Store, table: str, migrated_dsn: str
) -> None:
    with psycopg.connect(migrated_dsn) as c:
        c.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with pytest.raises(ProducerError, match="READ COMMITTED"):
            enqueue(
                c, event_type="e", payload={}, aggregate_type="t", aggregate_id=1, ordered=True, table=table
            )
        c.rollback()
        enqueue(c, event_type="e", payload={}, aggregate_type="t", aggregate_id=1, table=table)
        c.commit()
    assert count(conn, table) == 1


def test_invariant_9_producers_and_finalizers_racing_on_few_keys_never_lose_or_double_a_head(
    conn: psycopg.Connection[Any], store: Store, table: str, connect: Connect
) -> None:
    keys = ["K0", "K1", "K2"]
    produced: list[int] = []
    finished: list[tuple[str, int]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    producing = threading.Event()
    producing.set()

    def producer(seed: int) -> None:
        rnd = random.Random(seed)
        try:
            c = connect()
            for _ in range(40):
                events = [
                    Event("e", {}, "t", 1, ordering_key=rnd.choice(keys)) for _ in range(rnd.randint(1, 3))
                ]
                with c.transaction():
                    ids = enqueue_many(c, events, table=table)
                with lock:
                    produced.extend(ids)
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    def worker() -> None:
        try:
            c = connect()
            idle_since = time.monotonic()
            while time.monotonic() - idle_since < 2:
                claims = steps.claim(store, c, limit=5, lease=LONG, owner="w", max_attempts=5).claimed
                if not claims:
                    if producing.is_set():
                        idle_since = time.monotonic()
                    time.sleep(0.01)
                    continue
                idle_since = time.monotonic()
                for claim in claims:
                    row = c.execute(
                        sql.SQL("SELECT ordering_key FROM {} WHERE id = %s").format(store.table.identifier()),
                        [claim.id],
                    ).fetchone()
                    assert row is not None
                    with lock:
                        finished.append((row[0], claim.id))
                    assert steps.done(store, c, claim.id, claim.lease_version).applied
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    producers = [threading.Thread(target=producer, args=(n,)) for n in range(3)]
    workers = [threading.Thread(target=worker) for _ in range(2)]
    for t in producers + workers:
        t.start()
    for t in producers:
        t.join(timeout=60)
    producing.clear()
    for t in workers:
        t.join(timeout=60)
    assert not errors
    heads_consistent(conn, table)
    # Nothing stuck behind a lost head, nothing finished twice, every key in id order.
    assert sorted(i for _, i in finished) == sorted(produced)
    for k in keys:
        ids = [i for key, i in finished if key == k]
        assert ids == sorted(ids), k


@pytest.mark.parametrize("ordered", [None, True])
def test_invariant_9_a_head_s_done_hands_its_key_on_whether_or_not_the_caller_says_it_is_ordered(
    conn: psycopg.Connection[Any], store: Store, table: str, ordered: bool | None
) -> None:
    a = add(conn, 3, table=table, key="A")
    [u] = add(conn, table=table)
    claims = {
        c.id: c for c in steps.claim(store, conn, limit=10, lease=LONG, owner="w", max_attempts=5).claimed
    }
    assert sorted(claims) == [a[0], u]
    assert steps.done(store, conn, u, claims[u].lease_version, ordered=False if ordered else None).applied
    assert steps.done(store, conn, a[0], claims[a[0]].lease_version, ordered=ordered).applied
    # A second done of the same claim is a lost lease, and moves nothing further.
    assert steps.done(store, conn, a[0], claims[a[0]].lease_version, ordered=ordered).applied is False
    heads_consistent(conn, table)
    assert claim_ids(store, conn) == [a[1]]
