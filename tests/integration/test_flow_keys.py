"""Limits per key within an event type (DESIGN invariant 24), made to happen in the claim on
a real PostgreSQL: per-key concurrency over rows of several keys, a dead worker's key slot back
at the end of its lease, fair share between a big and a small key, a RateLimited outcome that
holds its key only, ordered keys in order under key limits.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from typing import Any

import psycopg
import pytest
from psycopg import sql
from support import steps

from outbox_celery import Store, TableName, migrate, ops
from outbox_celery.claim.executor import ClaimResult, ScanMarks
from outbox_celery.flow import Limit

from .helpers import LONG, add, claim, claim_together, fetch

A, B = "webhook.a", "webhook.b"


def keys_of(conn: psycopg.Connection[Any], table: str, result: ClaimResult) -> Counter[str | None]:
    ids = [c.id for c in result.claimed]
    rows = conn.execute(
        sql.SQL("SELECT limit_key FROM {} WHERE id = ANY(%s)").format(TableName.parse(table).identifier()),
        [ids],
    ).fetchall()
    return Counter(r[0] for r in rows)


def live_per_key(conn: psycopg.Connection[Any], table: str, event_type: str) -> dict[str, int]:
    rows = conn.execute(
        sql.SQL(
            "SELECT limit_key, count(*) FROM {} WHERE status = 'processing' AND lease_until > now()"
            " AND event_type = %s AND limit_key IS NOT NULL GROUP BY limit_key"
        ).format(TableName.parse(table).identifier()),
        [event_type],
    ).fetchall()
    return {str(k): int(n) for k, n in rows}


def test_invariant_24_key_concurrency_bounds_each_keys_live_deliveries(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    add(conn, 6, event_type=A, limit_key="t1")
    add(conn, 1, event_type=A, limit_key="t2")
    add(conn, 5, event_type=A, limit_key="t3")
    add(conn, 2, event_type=A)  # no limit key: only the type's own limits apply
    add(conn, 3, event_type=B, limit_key="t1")  # another type: its keys are its own
    limits = {A: Limit(key_concurrency=2)}
    first = claim(store, conn, limits=limits)
    # t1: two of A (its cap), three of B (unlimited).
    assert keys_of(conn, table, first) == Counter({"t1": 2 + 3, "t2": 1, "t3": 2, None: 2})
    assert live_per_key(conn, table, A) == {"t1": 2, "t2": 1, "t3": 2}
    assert first.flow_wait is not None  # keys at their cap: the listener looks again soon
    assert claim(store, conn, limits=limits).claimed == []
    # One of t1 finishes: one slot of t1, nothing of the others.
    done = next(
        c for c in first.claimed if c.event_type == A and fetch(conn, table, c.id)["limit_key"] == "t1"
    )
    assert steps.done(store, conn, done.id, done.lease_version)
    again = claim(store, conn, limits=limits)
    assert keys_of(conn, table, again) == Counter({"t1": 1})
    assert live_per_key(conn, table, A) == {"t1": 2, "t2": 1, "t3": 2}


def test_invariant_24_key_concurrency_and_the_types_concurrency_both_hold(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    for key in ["k1", "k2", "k3", "k4"]:
        add(conn, 3, event_type=A, limit_key=key)
    limits = {A: Limit(concurrency=5, key_concurrency=2)}
    first = claim(store, conn, limits=limits)
    assert len(first.claimed) == 5
    assert max(live_per_key(conn, table, A).values()) <= 2
    assert len(live_per_key(conn, table, A)) >= 3  # round robin: every key its turn first


def test_invariant_24_a_dead_workers_key_slot_comes_back_when_its_lease_ends(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    add(conn, 4, event_type=A, limit_key="t1")
    limits = {A: Limit(key_concurrency=1)}
    [taken] = claim(store, conn, limits=limits).claimed
    assert steps.start(store, conn, taken.id, taken.lease_version, lease=LONG, max_attempts=5) is not None
    assert claim(store, conn, limits=limits).claimed == []
    # The worker dies mid-handler: nothing finishes it, its lease runs out (shortened here).
    conn.execute(
        sql.SQL("UPDATE {} SET lease_until = now() - interval '1 second' WHERE id = %s").format(
            TableName.parse(table).identifier()
        ),
        [taken.id],
    )
    [again] = claim(store, conn, limits=limits).claimed
    # The slot came back, and the expired delivery is what takes it (at the front of its key),
    # fenced by a new lease_version; still one at a time.
    assert again.id == taken.id and again.lease_version > taken.lease_version
    assert live_per_key(conn, table, A) == {"t1": 1}
    assert claim(store, conn, limits=limits).claimed == []


def test_invariant_24_a_small_key_is_claimed_in_the_first_claim_beside_a_big_backlog(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    big = add(conn, 2000, event_type=A, limit_key="big")
    small = add(conn, 20, event_type=A, limit_key="small")
    assert max(big) < min(small)  # the big backlog is older: FIFO would take it first
    limits = {A: Limit(key_concurrency=50)}
    marks = ScanMarks()
    first = claim(store, conn, limits=limits, limit=40, marks=marks)
    got = keys_of(conn, table, first)
    assert got["small"] >= 10 and got["big"] >= 10, got
    # Every small message starts within a few claims while the big key has work left.
    seen = got["small"]
    for _ in range(3):
        for c in first.claimed:
            assert steps.done(store, conn, c.id, c.lease_version)
        first = claim(store, conn, limits=limits, limit=40, marks=marks)
        seen += keys_of(conn, table, first)["small"]
    assert seen == 20


def test_invariant_24_round_robin_reaches_every_key_when_keys_outnumber_the_batch(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    keys = [f"k{i:03d}" for i in range(120)]
    for key in keys:
        add(conn, 3, event_type=A, limit_key=key)
    limits = {A: Limit(key_concurrency=1)}
    served: Counter[str | None] = Counter()
    for _ in range(8):
        result = claim(store, conn, limits=limits, limit=20)
        assert len(result.claimed) == 20
        served += keys_of(conn, table, result)
        for c in result.claimed:
            assert steps.done(store, conn, c.id, c.lease_version)
    # 160 claims over 120 keys: every key at least once, none more than twice.
    assert set(served) == set(keys) and max(served.values()) <= 2


def test_invariant_24_rate_limited_holds_its_key_only(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    t1 = add(conn, 3, event_type=A, limit_key="t1")
    add(conn, 2, event_type=A, limit_key="t2")
    add(conn, 1, event_type=B)
    first = claim(store, conn, limit=1)
    [c] = first.claimed
    assert c.id == t1[0]
    assert steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5) is not None
    assert steps.rate_limited(store, conn, c.id, c.lease_version, delay=30.0, reason="429", max_age=3600.0)
    row = fetch(conn, table, c.id)
    assert row["status"] == "pending" and row["attempts"] == 0
    # No limits declared at all: the held key alone makes the claim go key by key.
    result = claim(store, conn)
    assert keys_of(conn, table, result) == Counter({"t2": 2, None: 1})
    assert result.held == ()  # the type itself is not held
    assert result.flow_wait is not None and 29 < result.flow_wait <= 30
    assert claim(store, conn).claimed == []
    # With a key limit declared too, the held key still waits.
    assert claim(store, conn, limits={A: Limit(key_concurrency=5)}).claimed == []


def test_invariant_24_ordered_keys_stay_in_order_under_key_limits(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    o1 = add(conn, 4, event_type=A, key="order:1", limit_key="t1")
    o2 = add(conn, 4, event_type=A, key="order:2", limit_key="t1")
    limits = {A: Limit(key_concurrency=1)}
    order: list[int] = []
    for _ in range(10):
        result = claim(store, conn, limits=limits)
        assert len(result.claimed) <= 1
        for c in result.claimed:
            order.append(c.id)
            assert steps.done(store, conn, c.id, c.lease_version)
    assert len(order) == 8
    assert [i for i in order if i in o1] == o1
    assert [i for i in order if i in o2] == o2


def test_invariant_24_a_table_named_like_a_word_of_the_claim_still_claims_by_key(
    conn: psycopg.Connection[Any],
) -> None:
    # The keyed claim's CTEs are named ck_*: an outbox table named "keys" or "rooms" (as the
    # benchmark's was) is not shadowed by one of them.
    for name in ["keys", "rooms"]:
        migrate(conn, name)
        add(conn, 3, table=name, event_type=A, limit_key="t1")
        got = steps.claim(
            Store(name),
            conn,
            limit=10,
            lease=LONG,
            owner="t",
            max_attempts=5,
            limits={A: Limit(key_concurrency=2)},
        )
        assert len(got.claimed) == 2


def test_invariant_24_pause_and_resume_one_key_from_python_and_the_cli(
    conn: psycopg.Connection[Any], store: Store, table: str, migrated_dsn: str
) -> None:
    t1 = add(conn, 2, event_type=A, limit_key="t1")
    add(conn, 2, event_type=A, limit_key="t2")
    assert ops.pause(conn, table, A, limit_key="t1") is True
    assert ops.pause(conn, table, A, limit_key="t1") is False  # already
    [state] = ops.key_states(conn, table)
    assert (state.event_type, state.limit_key, state.paused) == (A, "t1", True)
    # Paused: the type's other key flows, with or without a key limit declared.
    assert keys_of(conn, table, claim(store, conn)) == Counter({"t2": 2})
    assert claim(store, conn, limits={A: Limit(key_concurrency=5)}).claimed == []
    cli = [sys.executable, "-m", "outbox_celery", "--dsn", migrated_dsn, "--table", table]
    stats = subprocess.run([*cli, "stats"], capture_output=True, text=True, timeout=60, check=True)
    assert f"limit keys claimed by nobody: {A} key t1 (paused)" in stats.stdout
    resumed = subprocess.run(
        [*cli, "resume", A, "--key", "t1"], capture_output=True, text=True, timeout=60, check=True
    )
    assert f"resumed {A!r} key 't1'" in resumed.stdout
    assert ops.key_states(conn, table) == []
    assert sorted(c.id for c in claim(store, conn).claimed) == t1
    assert ops.resume(conn, table, A, limit_key="t1") is False


def test_invariant_24_key_rate_hands_out_one_burst_per_key_then_what_its_bucket_refills(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    add(conn, 20, event_type=A, limit_key="t1")
    add(conn, 20, event_type=A, limit_key="t2")
    limits = {A: Limit(key_rate=10.0)}  # a bucket of max(1, 10 x 0.2) = 2 starts per key
    first = claim(store, conn, limits=limits)
    assert keys_of(conn, table, first) == Counter({"t1": 2, "t2": 2})
    # Held by the keys' buckets: the listener claims again when the next token is due (0.1 s).
    assert first.flow_wait is not None and 0.05 <= first.flow_wait <= 0.1
    # Kept in the database: a fresh Store finds the buckets (nearly) empty.
    assert (
        len(
            steps.claim(
                Store(table), conn, limit=100, lease=LONG, owner="x", max_attempts=5, limits=limits
            ).claimed
        )
        <= 2
    )
    started = time.monotonic()
    taken = Counter[str | None]()
    while time.monotonic() - started < 1.0:
        taken += keys_of(conn, table, claim(store, conn, limits=limits))
        time.sleep(0.02)
    elapsed = time.monotonic() - started
    for key in ("t1", "t2"):
        # At most what the rate refilled (plus the token the fresh Store may have left behind).
        assert taken[key] <= 10 * (elapsed + 0.05) + 1, taken
        assert taken[key] >= 10 * (elapsed - 0.4), taken


def test_invariant_24_concurrent_claimers_never_exceed_a_key_limit_together(
    conn: psycopg.Connection[Any], store: Store, table: str, connect: Any
) -> None:
    for key in ["t1", "t2", "t3"]:
        add(conn, 60, event_type=A, limit_key=key)
    limits = {A: Limit(key_concurrency=2)}
    seen = claim_together(connect, table, limits, lambda c: live_per_key(c, table, A), claimers=4, rounds=12)
    assert max(max(s.values(), default=0) for s in seen) == 2, (
        "a key got more (or never as many) as its limit"
    )


def test_invariant_24_stats_and_the_metrics_show_paused_and_held_keys(
    conn: psycopg.Connection[Any], store: Store, table: str, migrated_dsn: str
) -> None:
    ops.pause(conn, table, A, limit_key="t1")
    add(conn, 1, event_type=A, limit_key="t2")
    [c] = claim(store, conn).claimed
    assert steps.rate_limited(store, conn, c.id, c.lease_version, delay=30.0, reason="429", max_age=3600.0)
    keys = ops.stats(conn, table).as_dict()["keys"]
    assert [(k["limit_key"], k["paused"]) for k in keys] == [("t1", True), ("t2", False)]
    assert 25 < keys[1]["held_for"] <= 30
    pytest.importorskip("prometheus_client")
    from outbox_celery.ops.metrics import OutboxCollector

    samples = {
        (s.name, s.labels.get("event_type"), s.labels.get("limit_key")): s.value
        for family in OutboxCollector(migrated_dsn, table).collect()
        for s in family.samples
    }
    assert samples[("outbox_limit_key_paused", A, "t1")] == 1
    assert 25 < samples[("outbox_limit_key_rate_limited_seconds", A, "t2")] <= 30
    assert ("outbox_event_type_paused", A, None) not in samples  # the type itself flows


def test_invariant_24_a_hold_that_ran_out_leaves_the_held_keys_index(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [first] = add(conn, 1, event_type=A, limit_key="t1")
    add(conn, 1, event_type=A, limit_key="t1")
    [c] = claim(store, conn, limit=1).claimed
    assert c.id == first
    assert steps.rate_limited(store, conn, c.id, c.lease_version, delay=0.3, reason="429", max_age=3600.0)
    flow_key = TableName.parse(table).identifier("_flow_key")
    held = sql.SQL("SELECT count(*) FROM {} WHERE paused OR paused_until IS NOT NULL").format(flow_key)
    assert conn.execute(held).fetchone() == (1,)
    assert claim(store, conn).claimed == []
    time.sleep(0.4)
    assert len(claim(store, conn).claimed) == 2  # the hold is over: both rows of the key
    assert conn.execute(held).fetchone() == (0,)  # and its row left the index the claims read
