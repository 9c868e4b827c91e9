"""Flow control in the claim: pause and resume, global limits, the RateLimited hold.

DESIGN invariant 22 (what a limit bounds) and 23 (pause and RateLimited), made to happen on a
real PostgreSQL with the Store the dispatcher uses, concurrent claimers included.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from psycopg import sql
from support import steps

from outbox_celery import Store, TableName, ops
from outbox_celery.claim.executor import ClaimResult, ScanMarks
from outbox_celery.flow import Limit

from .helpers import LONG, Connect, add, claim, claim_together, fetch

A, B = "webhook.a", "webhook.b"


def types_of(result: ClaimResult) -> list[str]:
    return sorted(c.event_type for c in result.claimed)


def _set(conn: psycopg.Connection[Any], table: str, ids: list[int], assignments: str) -> None:
    conn.execute(
        sql.SQL("UPDATE {} SET " + assignments + " WHERE id = ANY(%s)").format(
            TableName.parse(table).identifier()
        ),
        [ids],
    )


# -- pause and resume (invariant 23) -------------------------------------------------------------


def test_invariant_23_a_paused_event_type_is_claimed_by_nobody_until_resumed(
    conn: psycopg.Connection[Any], store: Store, table: str, migrated_dsn: str
) -> None:
    add(conn, 3, event_type=A)
    add(conn, 3, event_type=B)
    assert ops.pause(conn, table, A) is True
    assert ops.pause(conn, table, A) is False  # already paused: said so, nothing changes
    result = claim(store, conn)
    assert types_of(result) == [B] * 3
    assert result.held == (A,)
    assert claim(store, conn).claimed == []

    s = ops.stats(conn, table)
    assert [(f.event_type, f.paused) for f in s.flow] == [(A, True)]
    [a_stats] = [e for e in s.event_types if e.event_type == A]
    assert a_stats.paused and a_stats.ready == 3

    # Resume wakes the push listeners (the table's channel) and the next claim takes them.
    with psycopg.connect(migrated_dsn, autocommit=True) as listener:
        channel = store.listen(listener)
        assert ops.resume(conn, table, A) is True
        got = list(listener.notifies(timeout=5.0, stop_after=1))
        assert [n.channel for n in got] == [channel]
    assert types_of(claim(store, conn)) == [A] * 3
    assert ops.stats(conn, table).flow == []
    assert ops.resume(conn, table, A) is False


def test_invariant_23_resume_reaches_rows_behind_the_scan_marks_at_once(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    # While A is paused the general scans step over its rows and their marks move past them;
    # on resume the next claim of the same process must find them, not the full pass a minute on.
    marks = ScanMarks(lookback=0.0, full_every=3600.0)
    ops.pause(conn, table, A)
    add(conn, 2, event_type=A)
    add(conn, 2, event_type=B)
    assert types_of(claim(store, conn, marks=marks)) == [B, B]
    time.sleep(0.05)
    add(conn, 1, event_type=B)
    assert types_of(claim(store, conn, marks=marks)) == [B]  # the marks moved past A's rows
    passes = marks.full_passes
    ops.resume(conn, table, A)
    assert types_of(claim(store, conn, marks=marks)) == [A, A]
    assert marks.full_passes == passes + 1


def test_invariant_23_pause_and_resume_refuse_an_empty_event_type(
    conn: psycopg.Connection[Any], table: str
) -> None:
    with pytest.raises(ops.AdminError):
        ops.pause(conn, table, "")
    with pytest.raises(ops.AdminError):
        ops.resume(conn, table, "")


# -- concurrency (invariant 22) ------------------------------------------------------------------


def live(conn: psycopg.Connection[Any], table: str, event_type: str) -> int:
    row = conn.execute(
        sql.SQL(
            "SELECT count(*) FROM {} WHERE status = 'processing' AND lease_until > now() AND event_type = %s"
        ).format(TableName.parse(table).identifier()),
        [event_type],
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_invariant_22_a_concurrency_limit_bounds_live_deliveries_and_other_types_flow(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    add(conn, 10, event_type=A)
    add(conn, 5, event_type=B)
    limits = {A: Limit(concurrency=2)}
    first = claim(store, conn, limits=limits)
    assert types_of(first) == [A, A] + [B] * 5  # a limited type holds no other type still
    assert first.flow_wait is not None  # held at its limit: the listener looks again soon
    assert claim(store, conn, limits=limits).claimed == []
    # One finishes: one slot.
    done = next(c for c in first.claimed if c.event_type == A)
    assert steps.done(store, conn, done.id, done.lease_version)
    assert types_of(claim(store, conn, limits=limits)) == [A]
    assert live(conn, table, A) == 2


def test_invariant_22_a_dead_workers_slot_comes_back_when_its_lease_ends(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    add(conn, 5, event_type=A)
    limits = {A: Limit(concurrency=2)}
    taken = claim(store, conn, limits=limits).claimed
    assert len(taken) == 2
    for c in taken:
        assert steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5) is not None
    assert claim(store, conn, limits=limits).claimed == []
    # The worker running the first one dies: nothing finishes it, its lease runs out.
    _set(conn, table, [taken[0].id], "lease_until = now() - interval '1 second'")
    again = claim(store, conn, limits=limits).claimed
    # The slot came back, and the expired delivery itself is what takes it (re-claimed, fenced).
    assert [c.id for c in again] == [taken[0].id]
    assert again[0].lease_version == taken[0].lease_version + 1
    assert live(conn, table, A) == 2


def test_invariant_22_concurrent_claimers_never_exceed_the_limit_together(
    conn: psycopg.Connection[Any], store: Store, table: str, connect: Connect
) -> None:
    add(conn, 200, event_type=A)
    limits = {A: Limit(concurrency=3)}
    seen = claim_together(connect, table, limits, lambda c: live(c, table, A), claimers=4, rounds=15)
    assert max(seen) == 3, "the claimers together handed out more (or never as many) as the limit"


def test_invariant_22_a_limited_ordered_type_is_claimed_by_heads_in_order(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    k1 = add(conn, 3, event_type=A, key="k1")
    k2 = add(conn, 3, event_type=A, key="k2")
    limits = {A: Limit(concurrency=5)}
    first = claim(store, conn, limits=limits).claimed
    assert sorted(c.id for c in first) == [k1[0], k2[0]]  # heads only, whatever the room
    for c in first:
        assert steps.done(store, conn, c.id, c.lease_version)
    assert sorted(c.id for c in claim(store, conn, limits=limits).claimed) == [k1[1], k2[1]]


# -- rate (invariant 22) -------------------------------------------------------------------------


def test_invariant_22_a_rate_limit_hands_out_one_burst_then_what_the_rate_refills(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    add(conn, 50, event_type=A)
    add(conn, 3, event_type=B)
    limits = {A: Limit(rate=20.0)}  # burst max(1, 20 x 0.2) = 4
    first = claim(store, conn, limits=limits)
    assert types_of(first) == [A] * 4 + [B] * 3
    assert first.flow_wait is not None and 0 < first.flow_wait <= 0.1
    assert claim(store, conn, limits=limits).claimed == []
    started = time.monotonic()
    taken = 4
    while time.monotonic() - started < 1.0:
        taken += len(claim(store, conn, limits=limits).claimed)
        time.sleep(0.02)
    elapsed = time.monotonic() - started
    # At most the burst plus what the rate refilled meanwhile (and a token of rounding).
    assert taken <= 4 + 20 * (elapsed + 0.05) + 1
    assert taken >= 4 + 20 * (elapsed - 0.3)
    # Kept in the database, shared by every claimer: a fresh Store finds the bucket nearly empty
    # (at most the token refilled since the last claim), not a full burst.
    fresh = steps.claim(Store(table), conn, limit=100, lease=LONG, owner="x", max_attempts=5, limits=limits)
    assert len(fresh.claimed) <= 1


# -- RateLimited (invariant 23) ------------------------------------------------------------------


def test_invariant_23_rate_limited_holds_its_event_type_without_spending_attempts(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    a_ids = add(conn, 3, event_type=A)
    [c] = [x for x in claim(store, conn, limit=1).claimed]
    assert c.id == a_ids[0]
    assert steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5) is not None
    status = steps.rate_limited(
        store, conn, c.id, c.lease_version, delay=30.0, reason="HTTP 429", max_age=3600.0
    ).status
    assert status == "pending"
    row = fetch(conn, table, c.id)
    assert row["attempts"] == 0 and row["last_error"] == "rate limited: HTTP 429"
    assert 29 < row["available_in"] <= 30
    add(conn, 2, event_type=B)
    result = claim(store, conn)
    assert types_of(result) == [B, B]  # the rest of A waits; other types flow
    assert result.held == (A,) and result.flow_wait is not None and 29 < result.flow_wait <= 30
    [held] = ops.stats(conn, table).flow
    assert held.event_type == A and not held.paused and held.held_for is not None
    # A shorter hold never shortens the longer one; a stale finalize holds nothing.
    assert (
        steps.rate_limited(store, conn, c.id, c.lease_version, delay=1.0, reason="x", max_age=3600.0).applied
        is False
    )
    # resume ends the hold at once.
    assert ops.resume(conn, table, A) is True
    assert sorted(x.id for x in claim(store, conn).claimed) == a_ids[1:]


def test_invariant_23_a_later_hold_never_shortens_an_earlier_one(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    add(conn, 2, event_type=A)
    got = claim(store, conn).claimed
    assert steps.rate_limited(
        store, conn, got[0].id, got[0].lease_version, delay=60.0, reason="a", max_age=3600.0
    )
    assert steps.rate_limited(
        store, conn, got[1].id, got[1].lease_version, delay=1.0, reason="b", max_age=3600.0
    )
    [held] = ops.stats(conn, table).flow
    assert held.held_for is not None and held.held_for > 55


def test_a_table_not_migrated_to_0007_claims_without_flow_control(
    conn: psycopg.Connection[Any], store: Store, table: str, caplog: Any
) -> None:
    import logging

    conn.execute(sql.SQL("DROP TABLE {}").format(TableName.parse(table).identifier("_flow")))
    add(conn, 3, event_type=A)
    with caplog.at_level(logging.ERROR, logger="outbox_celery.db.store"):
        result = claim(Store(table), conn, limits={A: Limit(concurrency=1)})
    assert len(result.claimed) == 3
    assert "migration 0007 not applied" in caplog.text
    assert ops.stats(conn, table).flow == []


def test_invariant_22_several_limited_types_each_get_their_allowance_in_one_claim(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    c = "webhook.c"
    add(conn, 6, event_type=A)
    add(conn, 6, event_type=B)
    add(conn, 6, event_type=c)
    add(conn, 4, event_type=A, key="k")  # one head of A among them
    limits = {A: Limit(concurrency=2), B: Limit(concurrency=3)}
    assert types_of(claim(store, conn, limits=limits)) == [A, A, B, B, B] + [c] * 6
    # A batch smaller than the types: the bound holds and every row is accounted for.
    done = claim(store, conn, limits=limits, limit=1)
    assert done.claimed == []
    assert live(conn, table, A) == 2 and live(conn, table, B) == 3


def test_invariant_22_limited_and_unlimited_types_share_a_small_batch(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    add(conn, 20, event_type=A)
    add(conn, 20, event_type=B)
    roomy = {A: Limit(concurrency=1000)}
    got = claim(store, conn, limits=roomy, limit=10)
    # Half each: a limited type's backlog does not starve the others, nor the reverse.
    assert types_of(got) == [A] * 5 + [B] * 5
    assert types_of(claim(store, conn, limits=roomy, limit=30)) == [A] * 15 + [B] * 15
    # When the others run short the limited type takes what is left of the batch.
    add(conn, 40, event_type=A)
    add(conn, 2, event_type=B)
    assert types_of(claim(store, conn, limits=roomy, limit=30)) == [A] * 28 + [B] * 2


def test_invariant_23_the_metrics_show_paused_and_held_event_types(
    conn: psycopg.Connection[Any], store: Store, table: str, migrated_dsn: str
) -> None:
    pytest.importorskip("prometheus_client")
    from outbox_celery.ops.metrics import OutboxCollector

    ops.pause(conn, table, A)
    add(conn, 1, event_type=B)
    [c] = claim(store, conn).claimed
    assert steps.rate_limited(store, conn, c.id, c.lease_version, delay=30.0, reason="429", max_age=3600.0)
    samples = {
        (s.name, s.labels.get("event_type")): s.value
        for family in OutboxCollector(migrated_dsn, table).collect()
        for s in family.samples
    }
    assert samples[("outbox_event_type_paused", A)] == 1
    assert ("outbox_event_type_paused", B) not in samples
    assert 25 < samples[("outbox_event_type_rate_limited_seconds", B)] <= 30


def test_invariant_22_a_limited_types_expired_leases_are_scanned_from_its_own_mark(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    # Invariant 18 for the limited statements: they start at the type's marks, so a lease that
    # ended behind the mark (here: an hour before the previous claim, which no real lease end
    # does) waits for the next full pass, exactly as in the general statements.
    marks = ScanMarks(lookback=0.0, full_every=3600.0)
    limits = {A: Limit(concurrency=5)}
    [i] = add(conn, 1, event_type=A)
    [c] = claim(store, conn, limits=limits, marks=marks).claimed
    assert steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5) is not None
    assert claim(store, conn, limits=limits, marks=marks).claimed == []  # moves the marks to now()
    _set(conn, table, [i], "lease_until = now() - interval '1 hour'")
    assert claim(store, conn, limits=limits, marks=marks).claimed == []
    marks.forget(time.monotonic())
    assert [x.id for x in claim(store, conn, limits=limits, marks=marks).claimed] == [i]
