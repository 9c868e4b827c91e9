"""Invariant 18: under a pinned xmin horizon a claim steps over a bounded number of dead entries.

Each test holds a REPEATABLE READ snapshot open on a connection of its own, as a report, a
``pg_dump`` or an idle-in-transaction session does: while it is held VACUUM removes no dead row
version, and every claim, start and done leaves one behind in the outbox's partial indexes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from support import steps

from outbox_celery import Event, Store, enqueue, enqueue_many, ops
from outbox_celery.claim.executor import ScanMarks

from .helpers import LONG, PAST_SHORT, SHORT, Connect, Recording, add, fetch

CLAIM = {"lease": LONG, "owner": "test", "max_attempts": 5}


@pytest.fixture
def pin(connect: Connect) -> Iterator[psycopg.Connection[Any]]:
    """A snapshot held open: the xmin horizon stays where it is until the test ends."""
    c = connect()
    c.autocommit = False
    c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    c.execute("SELECT count(*) FROM pg_class")
    yield c
    c.rollback()


def churn(
    store: Store, conn: psycopg.Connection[Any], n: int, marks: ScanMarks, key: str | None = None
) -> None:
    """``n`` messages enqueued, claimed and finished: the row versions real deliveries leave."""
    for batch in range(0, n, 200):
        if key is None:
            add(conn, 200, table=store.table.name)
        else:  # one message per key: every one of them is a head
            events = [
                Event(
                    event_type="e",
                    payload={},
                    aggregate_type="a",
                    aggregate_id=str(i),
                    ordering_key=f"{key}{batch + i}",
                )
                for i in range(200)
            ]
            with conn.transaction():
                enqueue_many(conn, events, table=store.table.name)
        claimed = steps.claim(store, conn, limit=200, marks=marks, **CLAIM).claimed
        assert len(claimed) == 200
        if key is None:
            assert steps.done_many(store, conn, [(c.id, c.lease_version) for c in claimed]).applied == {
                c.id for c in claimed
            }
        else:
            for c in claimed:
                assert steps.done(store, conn, c.id, c.lease_version)


def shared_hits(
    conn: psycopg.Connection[Any], store: Store, query: str, index: str, params: dict[str, Any]
) -> int:
    """Buffers the scan of ``index`` touched in one run of a claim statement (rolled back)."""
    base = {
        **CLAIM,
        "event_types": None,
        "excluded": [],
        "limit": 10,
        "pending_since": None,
        "heads_since": None,
    }
    with conn.transaction(force_rollback=True):
        row = conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + store.queries[query], {**base, **params}
        ).fetchone()
    assert row is not None

    def scans(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if node.get("Node Type") == "Index Scan" and node.get("Index Name", "").endswith(index):
            yield node
        for child in node.get("Plans", []):
            yield from scans(child)

    [scan] = scans(row[0][0]["Plan"])
    return int(scan["Shared Hit Blocks"])


@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
def test_invariant_18_a_claim_under_a_pinned_horizon_starts_past_the_dead_entries(
    conn: psycopg.Connection[Any], store: Store, pin: psycopg.Connection[Any], ordered: bool
) -> None:
    marks = ScanMarks(lookback=0.05)
    key = "k" if ordered else None
    query, mark = ("claim_heads", "heads") if ordered else ("claim_pending", "pending")
    churn(store, conn, 10_000 if not ordered else 4000, marks, key=key)
    time.sleep(0.1)  # past the look-back
    add(conn, 10, table=store.table.name, key="another" if ordered else None)
    since = marks.since(getattr(marks, mark))
    assert since is not None
    from_mark = shared_hits(conn, store, query, f"_{mark}_idx", {f"{mark}_since": since})
    from_start = shared_hits(conn, store, query, f"_{mark}_idx", {f"{mark}_since": None})
    # From the start the scan visits the heap tuple behind every dead entry the pin keeps (one
    # buffer access per heap page in a run of entries that point into it).
    assert from_start > 50, from_start
    assert from_mark < from_start / 4, (from_mark, from_start)
    claimed = steps.claim(store, conn, limit=200, marks=marks, **CLAIM).claimed
    assert len(claimed) == (1 if ordered else 10)


def lease_entries_read(conn: psycopg.Connection[Any], store: Store) -> int:
    """Entries the scans of the lease index returned so far, dead ones included (the statistics
    this backend flushes when asked: its own reads are there at once)."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    row = conn.execute(
        "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE relid = %s::regclass AND indexrelname = %s",
        [store.table.qualified, f"{store.table.name}_lease_idx"],
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_invariant_18_a_full_pass_walks_the_dead_lease_entries_once(
    conn: psycopg.Connection[Any], store: Store, pin: psycopg.Connection[Any]
) -> None:
    # Under the pin, the claims of these messages leave a dead entry each in the lease index,
    # at a lease end that is past: in the range of every expired scan of a full pass.
    n = 3000
    for _ in range(0, n, 500):
        add(conn, 500, table=store.table.name)
        claimed = steps.claim(store, conn, limit=500, **{**CLAIM, "lease": SHORT}).claimed
        assert len(claimed) == 500
        assert len(steps.done_many(store, conn, [(c.id, c.lease_version) for c in claimed]).applied) == 500
    time.sleep(PAST_SHORT)
    before = lease_entries_read(conn, store)
    marks = ScanMarks()  # a process's first claim: a full pass
    assert steps.claim(store, conn, limit=10, marks=marks, **CLAIM).claimed == []
    walked = lease_entries_read(conn, store) - before
    # One walk (first_expired: no lease ran out) instead of one per expired scan (release_expired,
    # reap, claim_expired: three).
    assert n <= walked < 1.5 * n, walked
    assert marks.expired is not None  # and the next claim starts at this one's now()
    # A lease that does run out is still found, and the scans start at it.
    [late] = add(conn, 1, table=store.table.name)
    [c] = steps.claim(store, conn, limit=10, marks=ScanMarks(), **{**CLAIM, "lease": SHORT}).claimed
    assert c.id == late and steps.start(store, conn, c.id, c.lease_version, lease=SHORT, max_attempts=5)
    time.sleep(PAST_SHORT)
    before = lease_entries_read(conn, store)
    again = steps.claim(store, conn, limit=10, marks=ScanMarks(), **CLAIM).claimed
    assert [r.id for r in again] == [late]  # its worker died: re-claimed
    walked = lease_entries_read(conn, store) - before
    assert walked < 1.5 * n + 20, walked


def test_invariant_18_fenced_starts_and_finishes_read_by_primary_key_under_a_pin(
    conn: psycopg.Connection[Any], store: Store, pin: psycopg.Connection[Any]
) -> None:
    # Under the pin every claim and start leaves a dead entry in the lease index; autoanalyze
    # then counts few processing rows, and a fenced statement that the planner may answer from
    # that index reads all of it (a bitmap scan) for each start and each finish.
    n = 3000
    for _ in range(0, n, 500):
        add(conn, 500, table=store.table.name)
        claimed = steps.claim(store, conn, limit=500, **CLAIM).claimed
        for c in claimed[:50]:
            assert steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5) is not None
        assert len(steps.done_many(store, conn, [(c.id, c.lease_version) for c in claimed]).applied) == 500
    add(conn, 30, table=store.table.name)
    conn.execute(sql.SQL("ANALYZE {}").format(store.table.identifier()))
    claimed = steps.claim(store, conn, limit=30, **CLAIM).claimed
    assert len(claimed) == 30
    before = lease_entries_read(conn, store)
    for c in claimed:
        assert steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5) is not None
    assert len(steps.done_many(store, conn, [(c.id, c.lease_version) for c in claimed]).applied) == 30
    # By primary key: the lease index is not read at all (it held n dead entries and more).
    assert lease_entries_read(conn, store) - before == 0


def test_invariant_18_a_message_committed_behind_the_marks_is_claimed_by_the_next_full_pass(
    conn: psycopg.Connection[Any], store: Store, connect: Connect
) -> None:
    marks = ScanMarks(lookback=0.1, full_every=1.5)
    assert steps.claim(store, conn, limit=10, marks=marks, **CLAIM).claimed == []  # the first: a full pass
    slow = connect()
    with slow.transaction():
        late = enqueue(slow, event_type="late", payload={}, aggregate_type="t", aggregate_id="1")
        time.sleep(0.3)  # available_at is this transaction's start, now behind the look-back
        [quick] = add(conn, 1, table=store.table.name)
        assert [c.id for c in steps.claim(store, conn, limit=10, marks=marks, **CLAIM).claimed] == [quick]
    # Committed behind the marks: the next claims from the marks do not see it ...
    assert steps.claim(store, conn, limit=10, marks=marks, **CLAIM).claimed == []
    assert fetch(conn, store.table.name, late)["status"] == "pending"
    # ... the next full pass does: late, never lost.
    deadline = time.monotonic() + 5
    taken: list[int] = []
    while not taken and time.monotonic() < deadline:
        time.sleep(0.1)
        taken = [c.id for c in steps.claim(store, conn, limit=10, marks=marks, **CLAIM).claimed]
    assert taken == [late]
    assert marks.full_passes == 2


def test_invariant_18_a_promoted_head_enters_the_heads_index_when_it_becomes_claimable(
    conn: psycopg.Connection[Any], store: Store
) -> None:
    marks = ScanMarks(lookback=0.1)
    first, second = add(conn, 2, table=store.table.name, key="order-1")
    time.sleep(0.3)  # the second message's available_at is now behind any look-back
    [head] = steps.claim(store, conn, limit=10, marks=marks, **CLAIM).claimed
    assert head.id == first
    assert steps.done(store, conn, head.id, head.lease_version)
    promoted = fetch(conn, store.table.name, second)
    assert promoted["head"] and promoted["available_at"] > promoted["created_at"]
    time.sleep(0.2)
    assert [c.id for c in steps.claim(store, conn, limit=10, marks=marks, **CLAIM).claimed] == [second]


def test_invariant_18_a_delayed_head_keeps_its_later_available_at_when_promoted(
    conn: psycopg.Connection[Any], store: Store
) -> None:
    with conn.transaction():
        first = enqueue(conn, event_type="e", payload={}, aggregate_type="o", aggregate_id="1", ordered=True)
        second = enqueue(
            conn, event_type="e", payload={}, aggregate_type="o", aggregate_id="1", ordered=True, delay=300
        )
    [head] = steps.claim(store, conn, limit=10, **CLAIM).claimed
    assert head.id == first and steps.done(store, conn, head.id, head.lease_version)
    promoted = fetch(conn, store.table.name, second)
    assert promoted["head"] and promoted["available_in"] > 290


def test_invariant_18_leases_that_run_out_after_the_mark_come_back(
    conn: psycopg.Connection[Any], store: Store
) -> None:
    marks = ScanMarks(lookback=0.05)
    started, unstarted = add(conn, 2, table=store.table.name)
    claimed = steps.claim(store, conn, limit=10, marks=marks, **{**CLAIM, "lease": SHORT}).claimed
    assert {c.id for c in claimed} == {started, unstarted}
    v = {c.id: c.lease_version for c in claimed}
    assert steps.start(store, conn, started, v[started], lease=SHORT, max_attempts=5) is not None
    assert steps.claim(store, conn, limit=0, marks=marks, **CLAIM).claimed == []  # marks move to now()
    time.sleep(PAST_SHORT)
    result = steps.claim(store, conn, limit=10, marks=marks, **CLAIM)
    # started: its worker died, re-claimed. unstarted: its task never started, back to pending
    # and, a first loss (invariant 16), claimed again at once, ahead of the pending mark.
    assert sorted(c.id for c in result.claimed) == sorted([started, unstarted])
    assert result.lost == 1
    assert marks.full_passes == 1


def _lost_lease_and_a_head(conn: psycopg.Connection[Any], store: Store) -> list[int]:
    """A started claim whose lease ran out (its worker died) and a due ordered head: each only a
    scan the claim's first statement probed for can take."""
    [late] = add(conn, 1, table=store.table.name)
    [c] = steps.claim(store, conn, limit=10, **{**CLAIM, "lease": SHORT}).claimed
    assert c.id == late and steps.start(store, conn, c.id, c.lease_version, lease=SHORT, max_attempts=5)
    [head] = add(conn, 1, table=store.table.name, key="k")
    time.sleep(PAST_SHORT)
    return sorted([late, head])


def test_invariant_18_the_first_statement_probes_the_expired_and_heads_ranges(
    migrated_dsn: str, store: Store
) -> None:
    with psycopg.connect(migrated_dsn, autocommit=True, cursor_factory=Recording) as c:
        marks = ScanMarks()
        for _ in ("a full pass", "a claim from the marks"):
            fresh = add(c, 3, table=store.table.name)
            Recording.seen.clear()
            got = steps.claim(store, c, limit=10, marks=marks, **CLAIM).claimed
            assert sorted(r.id for r in got) == fresh
            names = Recording.names()
            # No lease ran out and no head is due: the first statement said so, neither ran.
            assert {"claim_settings_flow", "claim_pending"} <= set(names), names
            assert not {"first_expired", "claim_heads", "claim_expired"} & set(names), names
        # A lease that ran out and a head due: their statements run and take them.
        expected = _lost_lease_and_a_head(c, store)
        Recording.seen.clear()
        assert sorted(r.id for r in steps.claim(store, c, limit=10, marks=marks, **CLAIM).claimed) == expected
        names = Recording.names()
        assert {"claim_expired", "claim_heads"} <= set(names) and "first_expired" not in names, names


def test_invariant_18_marks_forgotten_after_the_probe_are_scanned_from_the_start(
    migrated_dsn: str, store: Store
) -> None:
    with psycopg.connect(migrated_dsn, autocommit=True, cursor_factory=Recording) as c:
        marks = ScanMarks(lookback=0.05, full_every=3600.0)
        assert steps.claim(store, c, limit=10, marks=marks, **CLAIM).claimed == []  # the first, full pass
        expected = _lost_lease_and_a_head(c, store)
        # As if the previous claims ran on a host whose clock was an hour ahead (a failover to a
        # lagging one since): the probe reads from marks an hour ahead and finds nothing, then
        # the clock check forgets the marks (invariant 25) and the scans run from the start.
        row = c.execute("SELECT now() + interval '1 hour'").fetchone()
        assert row is not None
        marks.pending = marks.heads = marks.expired = marks.db_now = row[0]
        Recording.seen.clear()
        assert sorted(r.id for r in steps.claim(store, c, limit=10, marks=marks, **CLAIM).claimed) == expected
        assert {"first_expired", "claim_expired", "claim_heads"} <= set(Recording.names())


def test_invariant_18_events_queued_during_a_pin_and_after_it_are_all_claimed(
    conn: psycopg.Connection[Any], store: Store, connect: Connect
) -> None:
    marks = ScanMarks(lookback=0.05, full_every=3600)
    pin = connect()
    pin.autocommit = False
    pin.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    pin.execute("SELECT 1")
    churn(store, conn, 400, marks)
    during = add(conn, 5, table=store.table.name)
    pin.rollback()
    after = add(conn, 5, table=store.table.name, payload=lambda i: [i])
    taken: set[int] = set()
    for _ in range(5):
        taken |= {c.id for c in steps.claim(store, conn, limit=200, marks=marks, **CLAIM).claimed}
    assert taken == set(during) | set(after)


def test_scan_marks_reject_negative_seconds() -> None:
    with pytest.raises(ValueError):
        ScanMarks(lookback=-1)
    events = [Event(event_type="e", payload={}, aggregate_type="a", aggregate_id="1")]
    assert events  # Event stays importable beside ScanMarks (public API)


def test_invariant_18_stats_name_what_holds_the_horizon_and_count_the_dead_versions(
    conn: psycopg.Connection[Any], store: Store, migrated_dsn: str
) -> None:
    held = psycopg.connect(migrated_dsn, application_name="nightly-report")
    pid = str(held.info.backend_pid)
    try:
        # A transaction that wrote (it has an xid), then idle in transaction: a forgotten session.
        held.execute("SELECT pg_current_xact_id()")
        time.sleep(1.1)
        churn(store, conn, 400, ScanMarks())
        deadline = time.monotonic() + 10
        h = ops.horizon(conn, store.table)
        while h.dead_row_versions < 400 and time.monotonic() < deadline:
            time.sleep(0.2)  # the statistics are flushed by the backends about once a second
            h = ops.horizon(conn, store.table)
        assert (h.kind, h.name, h.application) == (
            "transaction",
            str(held.info.backend_pid),
            "nightly-report",
        )
        assert h.state == "idle in transaction"
        assert h.seconds is not None and h.seconds >= 1
        assert h.dead_row_versions >= 400
        assert "nightly-report" in h.holder() and "idle in transaction" in h.holder()
        s = ops.stats(conn, store.table)
        assert s.horizon is not None and s.horizon.name == h.name
        assert s.as_dict()["horizon"]["application"] == "nightly-report"
    finally:
        held.close()
    # The closed session's backend exits a moment after the client closes: wait for it to go.
    deadline = time.monotonic() + 10
    while ops.horizon(conn, store.table).name == pid and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ops.horizon(conn, store.table).name != pid
