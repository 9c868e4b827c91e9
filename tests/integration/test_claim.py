"""Claims, leases and the fencing token (DESIGN invariants 1, 2, 3, 4, 5, 12)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg import sql
from support import steps

from outbox_celery import Store, TableName

from .helpers import LONG, PAST_SHORT, SHORT, Connect, add, claim_ids, count, fetch, fetch_all, stable


def test_invariant_1_concurrent_claims_never_return_the_same_row(
    conn: psycopg.Connection[Any], store: Store, table: str, connect: Connect
) -> None:
    ids = add(conn, 600, table=table)
    workers = 4
    barrier = threading.Barrier(workers)
    got: list[list[int]] = [[] for _ in range(workers)]
    errors: list[BaseException] = []
    deadline = time.monotonic() + 30

    def worker(n: int) -> None:
        try:
            c = connect()
            barrier.wait(timeout=10)
            while time.monotonic() < deadline:
                batch = claim_ids(store, c, limit=7, owner=f"w{n}")
                if not batch:
                    return
                got[n] += batch
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    everything = [i for batch in got for i in batch]
    assert len(everything) == len(set(everything)), "a row was handed to two claims"
    assert sorted(everything) == ids
    # Contended for real: more than one worker won rows.
    assert sum(1 for batch in got if batch) > 1
    rows = fetch_all(conn, table)
    assert all(r["status"] == "processing" and r["lease_version"] == 1 for r in rows)
    owners = {r["id"]: r["lease_owner"] for r in rows}
    for n, batch in enumerate(got):
        assert all(owners[i] == f"w{n}" for i in batch)


def test_invariant_2_a_row_whose_lease_has_not_expired_is_never_claimed(
    conn: psycopg.Connection[Any], store: Store, table: str, connect: Connect
) -> None:
    ids = add(conn, 20, table=table)
    long = claim_ids(store, conn, limit=10, lease=LONG)
    short_claims = steps.claim(store, conn, limit=10, lease=SHORT, owner="test", max_attempts=5).claimed
    short = [c.id for c in short_claims]
    assert sorted(short + long) == ids
    # Their worker starts them and dies (claims that never started wait out a delay instead).
    for c in short_claims:
        assert steps.start(store, conn, c.id, c.lease_version, lease=SHORT, max_attempts=5) is not None
    other = connect()
    # Nothing is claimable until the short leases run out (a slow machine may already be there).
    again = claim_ids(store, other)
    assert set(again) <= set(short)
    time.sleep(PAST_SHORT)
    again += claim_ids(store, other)
    # Only the expired half comes back, once; the live leases are untouched.
    assert sorted(again) == sorted(short)
    assert claim_ids(store, other) == []
    for i in long:
        row = fetch(conn, table, i)
        assert row["lease_version"] == 1
        assert row["lease_in"] > 50


def test_invariant_2_a_started_row_is_not_claimable_while_its_extended_lease_runs(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    [c] = steps.claim(store, conn, limit=1, lease=SHORT, owner="a", max_attempts=5).claimed
    # The start extends the short claim lease to the handler's lease.
    assert steps.start(store, conn, i, c.lease_version, lease=LONG, max_attempts=5) is not None
    time.sleep(PAST_SHORT)
    assert claim_ids(store, conn) == []
    assert fetch(conn, table, i)["lease_version"] == 1


def test_invariant_3_every_claim_increments_lease_version_and_every_start_increments_attempts(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    row = fetch(conn, table, i)
    assert (row["status"], row["lease_version"], row["attempts"]) == ("pending", 0, 0)
    for n in range(1, 4):
        [c] = steps.claim(store, conn, limit=5, lease=SHORT, owner=f"claim{n}", max_attempts=5).claimed
        assert c.lease_version == n
        row = fetch(conn, table, i)
        assert (row["status"], row["lease_version"], row["attempts"]) == ("processing", n, n - 1)
        assert row["lease_owner"] == f"claim{n}"
        assert c.lease_until == row["lease_until"]
        msg = steps.start(store, conn, i, c.lease_version, lease=SHORT, max_attempts=5)
        assert msg is not None
        assert (msg.id, msg.lease_version, msg.attempts) == (i, n, n)
        row = fetch(conn, table, i)
        assert (row["lease_version"], row["attempts"]) == (n, n)
        time.sleep(PAST_SHORT)


def test_invariant_3_start_extends_the_lease_and_returns_the_message(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table, payload=lambda _: {"order": 7, "lines": ["a", "ü"]})
    [c] = steps.claim(store, conn, limit=1, lease=5, owner="a", max_attempts=5).claimed
    assert 3 < fetch(conn, table, i)["lease_in"] <= 5
    msg = steps.start(store, conn, i, c.lease_version, lease=120, max_attempts=5, starter="me")
    assert msg is not None
    assert 115 < fetch(conn, table, i)["lease_in"] <= 120
    assert msg.payload == {"order": 7, "lines": ["a", "ü"]}
    assert (msg.event_type, msg.aggregate_type, msg.aggregate_id) == ("thing.happened", "thing", "0")
    assert msg.idempotency_key == f"{store.instance(conn)}/public.{store.table.qualified}:{i}"
    assert msg.legacy_idempotency_key == f"public.{store.table.qualified}:{i}"
    # A start never shortens a lease, nor does its retry after a lost reply (same starter).
    again = steps.start(store, conn, i, c.lease_version, lease=1, max_attempts=5, starter="me")
    assert again is not None
    assert again.attempts == 1
    assert fetch(conn, table, i)["lease_in"] > 110


def _hot_updates(connect: Connect, table: str) -> int:
    """The table's heap-only updates so far, as the statistics say (every backend flushed)."""
    other = connect()
    other.execute("SELECT pg_stat_clear_snapshot()")
    row = other.execute(
        "SELECT n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = %s::regclass", [table]
    ).fetchone()
    assert row is not None
    return int(row[0])


def _flush_stats(conn: psycopg.Connection[Any]) -> None:
    """Have this session's statistics reach the shared ones (PostgreSQL 15+, at its next idle)."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SELECT 1")
    time.sleep(0.1)


def test_invariant_33_a_start_soon_after_its_claim_keeps_the_claims_lease_and_changes_no_index(
    conn: psycopg.Connection[Any], store: Store, table: str, connect: Connect
) -> None:
    ids = add(conn, table=table, n=20)
    claimed = steps.claim(store, conn, limit=20, lease=LONG, owner="a", max_attempts=5).claimed
    leases = {c.id: c.lease_until for c in claimed}
    _flush_stats(conn)
    hot_before = _hot_updates(connect, table)
    for c in claimed:
        assert steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5) is not None
    _flush_stats(conn)
    # Started within 2.5% of a lease after the claim: lease_until as the claim gave it.
    assert {i: fetch(conn, table, i)["lease_until"] for i in ids} == leases
    assert all(fetch(conn, table, i)["attempts"] == 1 for i in ids)
    # No indexed column changed: PostgreSQL kept every start on its row's page (HOT) where
    # the page had room, and the claim leaves room on a page it rewrote (at least half here).
    assert _hot_updates(connect, table) - hot_before >= len(ids) // 2


def test_invariant_33_a_start_late_in_its_claims_lease_gets_a_whole_lease_from_now(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    [c] = steps.claim(store, conn, limit=1, lease=2.0, owner="a", max_attempts=5).claimed
    time.sleep(0.2)  # 10% of the lease gone: less than START_KEEP of it is left
    assert steps.start(store, conn, i, c.lease_version, lease=2.0, max_attempts=5) is not None
    row = fetch(conn, table, i)
    assert row["lease_until"] > c.lease_until
    assert 1.9 < row["lease_in"] <= 2.0


def test_invariant_4_a_stale_owner_changes_nothing_and_says_so(
    conn: psycopg.Connection[Any],
    store: Store,
    table: str,
    connect: Connect,
    caplog: pytest.LogCaptureFixture,
) -> None:
    [i] = add(conn, table=table)
    [old] = steps.claim(store, conn, limit=1, lease=SHORT, owner="stale", max_attempts=5).claimed
    assert steps.start(store, conn, i, old.lease_version, lease=SHORT, max_attempts=5) is not None
    time.sleep(PAST_SHORT)
    fresh = connect()
    [new] = steps.claim(store, fresh, limit=1, lease=LONG, owner="fresh", max_attempts=5).claimed
    assert (new.id, new.lease_version) == (i, old.lease_version + 1)
    before = stable(fetch(conn, table, i))
    lost_before = store.get_stats().get("lost_leases", 0)

    v = old.lease_version
    with caplog.at_level(logging.WARNING, logger="outbox_celery.db.store"):
        assert steps.start(store, conn, i, v, lease=LONG, max_attempts=5) is None
        assert steps.done(store, conn, i, v).applied is False
        assert steps.retry(store, conn, i, v, delay=0, error="x", max_attempts=5).applied is False
        assert steps.defer(store, conn, i, v, delay=0, reason="x", max_age=3600).applied is False
        assert steps.dead(store, conn, i, v, error="x").applied is False
        assert steps.record_error(store, conn, i, v, error="x").applied is False
        assert steps.extend_lease(store, conn, i, v, seconds=600) is False
        assert steps.postpone(store, conn, i, v, delay=0, error="x").applied is False
        assert steps.release(store, conn, [old]) == 0

    assert stable(fetch(conn, table, i)) == before
    assert store.get_stats()["lost_leases"] - lost_before == 7
    lost = [r for r in caplog.records if "lost lease" in r.getMessage()]
    assert len(lost) == 7
    assert all(getattr(r, "outbox_id", None) == i and getattr(r, "lease_version", None) == v for r in lost)
    # The current owner still wins.
    assert steps.start(store, fresh, i, new.lease_version, lease=LONG, max_attempts=5) is not None
    assert steps.done(store, fresh, i, new.lease_version).applied
    assert fetch(conn, table, i)["status"] == "done"


def test_invariant_4_finalizing_a_finished_row_again_changes_nothing(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    [c] = steps.claim(store, conn, limit=1, lease=LONG, owner="a", max_attempts=5).claimed
    assert steps.start(store, conn, i, c.lease_version, lease=LONG, max_attempts=5) is not None
    assert steps.done(store, conn, i, c.lease_version).applied
    before = stable(fetch(conn, table, i))
    # A redelivered task with the same (id, version) after the row is done.
    assert steps.start(store, conn, i, c.lease_version, lease=LONG, max_attempts=5) is None
    assert steps.done(store, conn, i, c.lease_version).applied is False
    assert steps.dead(store, conn, i, c.lease_version, error="late").applied is False
    assert (
        steps.retry(store, conn, i, c.lease_version, delay=0, error="late", max_attempts=5).applied is False
    )
    assert stable(fetch(conn, table, i)) == before


def test_invariant_5_exhausted_attempts_go_dead_at_the_next_claim_and_are_never_claimed_again(
    conn: psycopg.Connection[Any], store: Store, table: str, caplog: pytest.LogCaptureFixture
) -> None:
    [i] = add(conn, table=table)
    [healthy] = add(conn, table=table)
    for n in range(1, 4):
        result = steps.claim(store, conn, limit=10, lease=SHORT, owner="w", max_attempts=3)
        assert i in [c.id for c in result.claimed]
        version = next(c.lease_version for c in result.claimed if c.id == i)
        # The handler starts and its worker dies: no finalize.
        assert steps.start(store, conn, i, version, lease=SHORT, max_attempts=3) is not None
        assert fetch(conn, table, i)["attempts"] == n
        time.sleep(PAST_SHORT)
    with caplog.at_level(logging.WARNING, logger="outbox_celery.db.store"):
        result = steps.claim(store, conn, limit=10, lease=SHORT, owner="w", max_attempts=3)
    assert result.reaped == 1
    assert i not in [c.id for c in result.claimed]
    row = fetch(conn, table, i)
    assert row["status"] == "dead"
    assert row["attempts"] == 3
    assert row["lease_until"] is None
    assert "attempts exhausted" in row["last_error"]
    assert "3 of 3" in row["last_error"]
    assert any("went dead" in r.getMessage() for r in caplog.records)
    # The healthy neighbour was claimed but never started: no attempt spent, not dead.
    assert fetch(conn, table, healthy)["status"] in ("pending", "processing")
    assert fetch(conn, table, healthy)["attempts"] == 0
    time.sleep(PAST_SHORT)
    for _ in range(3):
        assert i not in claim_ids(store, conn, lease=SHORT, max_attempts=3)
    assert fetch(conn, table, i)["status"] == "dead"


def test_invariant_5_an_expired_lease_with_attempts_left_is_reclaimed(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    [c] = steps.claim(store, conn, limit=1, lease=SHORT, owner="a", max_attempts=3).claimed
    assert steps.start(store, conn, i, c.lease_version, lease=SHORT, max_attempts=3) is not None
    steps.record_error(store, conn, i, c.lease_version, error="ZeroDivisionError: boom")
    time.sleep(PAST_SHORT)
    result = steps.claim(store, conn, limit=1, lease=LONG, owner="b", max_attempts=3)
    assert result.reaped == 0
    assert [(x.id, x.lease_version) for x in result.claimed] == [(i, 2)]
    row = fetch(conn, table, i)
    assert (row["status"], row["attempts"], row["lease_owner"]) == ("processing", 1, "b")
    assert row["last_error"] == "ZeroDivisionError: boom"


def test_invariant_5_a_redelivered_start_after_the_last_attempt_goes_dead_at_the_reap_not_at_once(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    # The handler killed its worker; the broker redelivers the same task (acks late). The first
    # run may as well still be going, so the redelivered start calls nothing and
    # judges nothing; once the lease has run out the reap makes the row dead (invariant 5).
    [i] = add(conn, table=table)
    [c] = steps.claim(store, conn, limit=1, lease=SHORT, owner="a", max_attempts=1).claimed
    assert steps.start(store, conn, i, c.lease_version, lease=SHORT, max_attempts=1) is not None
    assert steps.start(store, conn, i, c.lease_version, lease=SHORT, max_attempts=1) is None
    assert (fetch(conn, table, i)["status"], fetch(conn, table, i)["attempts"]) == ("processing", 1)
    time.sleep(PAST_SHORT)
    assert steps.claim(store, conn, limit=1, lease=LONG, owner="b", max_attempts=1).reaped == 1
    row = fetch(conn, table, i)
    assert (row["status"], row["attempts"]) == ("dead", 1)
    assert "attempts exhausted" in row["last_error"]
    assert row["lease_until"] is None


def test_invariant_5_a_claim_that_never_started_with_no_attempt_left_goes_dead_at_its_start(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    # max_attempts lowered by a deploy: the row already spent more than the new limit.
    [i] = add(conn, table=table)
    [c] = steps.claim(store, conn, limit=1, lease=LONG, owner="a", max_attempts=5).claimed
    conn.execute(sql.SQL("UPDATE {} SET attempts = 2").format(TableName.parse(table).identifier()))
    assert steps.start(store, conn, i, c.lease_version, lease=LONG, max_attempts=2) is None
    row = fetch(conn, table, i)
    assert (row["status"], row["attempts"]) == ("dead", 2)
    assert "attempts exhausted" in row["last_error"]


def test_invariant_2_a_second_start_of_a_started_claim_is_refused_while_its_lease_runs(
    conn: psycopg.Connection[Any], store: Store, table: str, connect: Any
) -> None:
    # With the lease heartbeat a handler may run for handler_time_limit; a broker
    # that redelivers its unacked task meanwhile (Redis visibility_timeout, RabbitMQ
    # consumer_timeout) hands the same lease_version to a second worker. Its start is refused:
    # one claim never runs twice at once, and the first run's finalize still wins.
    [i] = add(conn, table=table)
    [c] = steps.claim(store, conn, limit=1, lease=LONG, owner="a", max_attempts=5).claimed
    first, second = connect(), connect()
    assert steps.start(store, first, i, c.lease_version, lease=LONG, max_attempts=5) is not None
    for _ in range(3):
        assert steps.start(store, second, i, c.lease_version, lease=LONG, max_attempts=5) is None
    row = fetch(conn, table, i)
    assert (row["status"], row["attempts"]) == ("processing", 1)
    assert store.get_stats()["stale_starts"] == 3
    assert steps.done(store, first, i, c.lease_version).applied


def test_invariant_3_a_claim_whose_start_never_happens_spends_no_attempt(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    # More lost tasks than max_attempts: the message must not go dead for the broker's sins.
    # Each lost claim sends it back to pending (invariants 10, 16). The first is claimable at
    # once (its lease was the wait: the run that gives it back claims it again); each one after
    # it waits a lease that doubles: one, two... so a queue nobody consumes holds less and less
    # of the bound.
    assert claim_ids(store, conn, lease=SHORT, max_attempts=3) == [i]
    time.sleep(PAST_SHORT)
    result = steps.claim(store, conn, limit=10, lease=SHORT, owner="a", max_attempts=3)
    assert ([c.id for c in result.claimed], result.lost) == ([i], 1)
    for n in range(2, 5):
        row = fetch(conn, table, i)
        assert (row["status"], row["lease_version"], row["attempts"]) == ("processing", n, 0)
        time.sleep(PAST_SHORT)
        result = steps.claim(store, conn, limit=10, lease=SHORT, owner="a", max_attempts=3)
        assert (result.claimed, result.lost) == ([], 1)
        row = fetch(conn, table, i)
        assert (row["status"], row["attempts"], row["lease_until"]) == ("pending", 0, None)
        assert row["lease_version"] - row["started_version"] == n
        assert SHORT * 2 ** (n - 2) - 0.1 < row["available_in"] <= SHORT * 2 ** (n - 2)
        time.sleep(max(0.0, row["available_in"]) + 0.05)
        if n < 4:
            assert claim_ids(store, conn, lease=SHORT, max_attempts=3) == [i]
    [c] = steps.claim(store, conn, limit=1, lease=LONG, owner="a", max_attempts=3).claimed
    msg = steps.start(store, conn, i, c.lease_version, lease=LONG, max_attempts=3)
    assert msg is not None
    assert msg.attempts == 1


def test_invariant_12_release_puts_rows_back_to_pending_at_once_without_spending_an_attempt(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    ids = add(conn, 5, table=table)
    claims = steps.claim(store, conn, limit=10, lease=LONG, owner="a", max_attempts=3).claimed
    assert sorted(c.id for c in claims) == ids
    # The broker refused the first three tasks.
    assert steps.release(store, conn, claims[:3]) == 3
    released = {c.id for c in claims[:3]}
    for i in ids:
        row = fetch(conn, table, i)
        if i in released:
            assert row["status"] == "pending"
            assert row["lease_until"] is None
            assert row["available_in"] <= 0
            assert row["attempts"] == 0
        else:
            assert row["status"] == "processing"
    # Claimable again at once, with a new fencing token; the old one is dead.
    again = steps.claim(store, conn, limit=10, lease=LONG, owner="b", max_attempts=3).claimed
    assert sorted(c.id for c in again) == sorted(released)
    assert all(c.lease_version == 2 for c in again)
    assert steps.release(store, conn, claims[:3]) == 0
    assert steps.release(store, conn, []) == 0
    assert count(conn, table, "status = 'processing'") == 5


def test_extend_lease_is_fenced(conn: psycopg.Connection[Any], store: Store, table: str) -> None:
    [i] = add(conn, table=table)
    [c] = steps.claim(store, conn, limit=1, lease=SHORT, owner="a", max_attempts=3).claimed
    assert steps.start(store, conn, i, c.lease_version, lease=SHORT, max_attempts=3) is not None
    assert steps.extend_lease(store, conn, i, c.lease_version, seconds=90) is True
    assert 85 < fetch(conn, table, i)["lease_in"] <= 90
    # Never shortens.
    assert steps.extend_lease(store, conn, i, c.lease_version, seconds=1) is True
    assert fetch(conn, table, i)["lease_in"] > 85
    assert claim_ids(store, conn, max_attempts=3) == []
    assert steps.extend_lease(store, conn, i, c.lease_version + 1, seconds=300) is False
    assert fetch(conn, table, i)["lease_in"] <= 90
    assert steps.done(store, conn, i, c.lease_version).applied
    assert steps.extend_lease(store, conn, i, c.lease_version, seconds=300) is False
    assert fetch(conn, table, i)["lease_until"] is None


def test_an_extended_lease_outlives_the_claim_lease(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [i] = add(conn, table=table)
    [c] = steps.claim(store, conn, limit=1, lease=SHORT, owner="a", max_attempts=3).claimed
    assert steps.extend_lease(store, conn, i, c.lease_version, seconds=LONG)
    time.sleep(PAST_SHORT)
    assert claim_ids(store, conn, max_attempts=3) == []
    assert steps.done(store, conn, i, c.lease_version).applied


def test_claim_respects_limit_and_event_type_filter(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    mails = add(conn, 5, table=table, event_type="mail.send")
    hooks = add(conn, 5, table=table, event_type="webhook.post")
    result = steps.claim(
        store, conn, limit=3, lease=LONG, owner="a", max_attempts=3, event_types=["mail.send"]
    )
    assert [c.id for c in result.claimed] == mails[:3]
    assert all(c.event_type == "mail.send" for c in result.claimed)
    assert steps.claim(store, conn, limit=0, lease=LONG, owner="a", max_attempts=3).claimed == []
    rest = claim_ids(store, conn, limit=100)
    assert sorted(rest) == sorted(mails[3:] + hooks)


def test_claim_takes_due_rows_oldest_first_and_skips_future_ones(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    later = add(conn, 3, table=table, delay=LONG)
    now = add(conn, 3, table=table)
    assert claim_ids(store, conn, limit=2) == now[:2]
    assert claim_ids(store, conn) == now[2:]
    assert claim_ids(store, conn) == []
    assert all(fetch(conn, table, i)["status"] == "pending" for i in later)


def test_claim_counts_are_reported(conn: psycopg.Connection[Any], table: str) -> None:
    store = Store(table)
    add(conn, 4, table=table)
    claims = steps.claim(store, conn, limit=3, lease=LONG, owner="a", max_attempts=3).claimed
    assert store.in_flight(conn) == 3
    steps.release(store, conn, claims[:1])
    assert store.get_stats()["claimed"] == 3
    assert store.get_stats()["released"] == 1
    assert store.in_flight(conn) == 2


def test_a_store_runs_the_query_texts_it_was_given_and_refuses_unknown_names(
    conn: psycopg.Connection[Any], table: str
) -> None:
    # The benchmarks' seam: a replaced named query runs in place of the shipped one.
    store = Store(table, queries={"count_in_flight": "SELECT 42 AS n FROM {table} LIMIT 1"})
    add(conn, table=table)
    assert store.in_flight(conn) == 42
    assert "claim_heads" in store.queries
    with pytest.raises(ValueError, match="no named queries"):
        Store(table, queries={"no_such_query": "SELECT 1"})
