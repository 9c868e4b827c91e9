"""Flow control's bounds (DESIGN invariant 25), made to happen in the claim on a real PostgreSQL:
keys behind a window of held keys, a resumed key behind the scan marks, concurrent first claims
of newly limited types, a RateLimited hold past max_defer_age, per-key state pruned, a key at its
key_concurrency that waits for a finish rather than a timer, a claim with no limit that runs no
flow statement, and the database clock stepping back.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from support import steps

from outbox_celery import Store, TableName, migrate, ops
from outbox_celery.claim.executor import ScanMarks
from outbox_celery.errors import MigrationError
from outbox_celery.flow import CAP_RECHECK, Limit

from .helpers import LONG, Connect, Recording, add, claim, fetch, lock_waiters

A, B = "webhook.a", "webhook.b"


def _flow_key(table: str) -> sql.Composable:
    return TableName.parse(table).identifier("_flow_key")


def _flow(table: str) -> sql.Composable:
    return TableName.parse(table).identifier("_flow")


def _keys(conn: psycopg.Connection[Any], table: str, ids: Sequence[int]) -> Counter[str | None]:
    rows = conn.execute(
        sql.SQL("SELECT limit_key FROM {} WHERE id = ANY(%s)").format(TableName.parse(table).identifier()),
        [list(ids)],
    ).fetchall()
    return Counter(r[0] for r in rows)


def test_invariant_24_keys_behind_a_window_of_held_keys_are_claimed(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    # 60 paused keys sort before "zeta": more than one claim's walk (50 keys at least).
    for i in range(60):
        add(conn, 1, event_type=A, limit_key=f"k{i:02d}")
        ops.pause(conn, table, A, limit_key=f"k{i:02d}")
    [zeta] = add(conn, 1, event_type=A, limit_key="zeta")
    limits = {A: Limit(key_concurrency=1)}
    got: list[int] = []
    for _ in range(3):
        got += [c.id for c in claim(store, conn, limits=limits, limit=10).claimed]
    assert got == [zeta]


@pytest.mark.parametrize("limits", [None, {A: Limit(concurrency=50)}], ids=["no-limit", "concurrency"])
@pytest.mark.parametrize("how", ["resume", "hold-ends"])
def test_invariant_25_a_key_back_from_a_pause_or_hold_is_claimed_at_once_behind_the_scan_marks(
    conn: psycopg.Connection[Any], store: Store, table: str, how: str, limits: dict[str, Limit] | None
) -> None:
    marks = ScanMarks(lookback=0.3, full_every=3600.0)
    waiting = add(conn, 2, event_type=A, limit_key="t1")
    if how == "resume":
        ops.pause(conn, table, A, limit_key="t1")
    else:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (event_type, limit_key, paused_until)"
                " VALUES (%s, 't1', now() + interval '1 hour')"
            ).format(_flow_key(table)),
            [A],
        )
    assert claim(store, conn, marks=marks, limits=limits).claimed == []  # the first, full pass
    # Other rows of the type flow and move the marks on, well past t1's rows.
    time.sleep(0.8)
    for _ in range(2):
        add(conn, 1, event_type=A)
        assert len(claim(store, conn, marks=marks, limits=limits).claimed) == 1
    passes = marks.full_passes
    if how == "resume":
        assert ops.resume(conn, table, A, limit_key="t1")
    else:
        ended = sql.SQL("UPDATE {} SET paused_until = now() - interval '1 second'")
        conn.execute(ended.format(_flow_key(table)))
    assert sorted(c.id for c in claim(store, conn, marks=marks, limits=limits).claimed) == waiting
    assert marks.full_passes <= passes + 1


def _until(what: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_invariant_22_first_claims_of_newly_limited_types_never_deadlock(
    conn: psycopg.Connection[Any], connect: Connect, table: str
) -> None:
    # Claimers on their own connections, made to interleave at the first claims of types that
    # have no flow row yet, while an operator pauses an existing one. A claim that locks existing
    # rows, then inserts the new ones, then locks again, held "z" and waited for "a" while
    # another held "a" and waited for "z": a deadlock. The rows are now created before any flow
    # lock and locked in one order.
    flow = _flow(table)
    conn.execute(sql.SQL("INSERT INTO {} (event_type) VALUES ('z')").format(flow))
    blocker = connect()
    blocker.autocommit = False
    blocker.execute(sql.SQL("INSERT INTO {} (event_type) VALUES ('b')").format(flow))  # not committed
    errors: list[BaseException] = []

    def claimer(limits: dict[str, Limit]) -> None:
        try:
            steps.claim(
                Store(table), connect(), limit=10, lease=LONG, owner="t", max_attempts=5, limits=limits
            )
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    first = threading.Thread(target=claimer, args=({"a": Limit(concurrency=2), "b": Limit(concurrency=2)},))
    first.start()
    _until(lambda: lock_waiters(conn) == 1)  # it created "a" and waits for the blocker's "b"
    ops.pause(conn, table, "z")
    second = threading.Thread(target=claimer, args=({"a": Limit(concurrency=2), "z": Limit(concurrency=2)},))
    second.start()
    _until(lambda: lock_waiters(conn) == 2)  # it waits for the first's "a"
    blocker.commit()
    first.join(30)
    second.join(30)
    assert not [e for e in errors if isinstance(e, psycopg.errors.DeadlockDetected)], errors
    assert not errors, errors


@pytest.mark.parametrize("limit_key", [None, "t1"])
def test_invariant_25_a_rate_limited_hold_lasts_max_defer_age_at_most(
    conn: psycopg.Connection[Any], store: Store, table: str, limit_key: str | None
) -> None:
    [first] = add(conn, 1, event_type=A, limit_key=limit_key)
    later = add(conn, 2, event_type=A, limit_key=limit_key)
    [c] = claim(store, conn, limit=1).claimed
    assert c.id == first
    assert steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=5) is not None
    month = 30 * 86400.0
    assert steps.rate_limited(store, conn, c.id, c.lease_version, delay=month, reason="429", max_age=1.0)
    assert fetch(conn, table, first)["status"] == "dead"  # held past max_defer_age, as a Defer
    held = sql.SQL("SELECT extract(epoch FROM paused_until - now())::float8 FROM {}").format(
        _flow(table) if limit_key is None else _flow_key(table)
    )
    [(seconds,)] = conn.execute(held).fetchall()
    assert 0 < seconds <= 1.0  # the hold: max_defer_age at most, not 30 days
    assert claim(store, conn).claimed == []
    time.sleep(1.1)
    # The type's later messages are claimed again (and would go dead past max_defer_age).
    assert sorted(x.id for x in claim(store, conn).claimed) == later


def test_invariant_25_per_key_state_is_pruned_when_a_key_has_nothing_left(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    keys = [f"k{i:03d}" for i in range(300)]
    for k in keys:
        add(conn, 1, event_type=A, limit_key=k)
    limits = {A: Limit(key_rate=1000)}  # a bucket per key, full again within a millisecond
    claimed = []
    while got := claim(store, conn, limits=limits, limit=100).claimed:
        claimed += got
    assert len(claimed) == 300
    for c in claimed:
        assert steps.done(store, conn, c.id, c.lease_version)
    ops.pause(conn, table, A, limit_key="paused")  # worth keeping
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (event_type, limit_key, tokens, refilled_at, full_at)"
            " VALUES (%s, 'busy', 0, now(), now() + interval '1 hour')"
        ).format(_flow_key(table)),
        [A],
    )  # a bucket still refilling: worth keeping
    count = sql.SQL("SELECT count(*) FROM {}").format(_flow_key(table))
    assert conn.execute(count).fetchone() == (302,)
    # Untouched for a minute: as if the minute had passed.
    conn.execute(sql.SQL("UPDATE {} SET updated_at = now() - interval '2 minutes'").format(_flow_key(table)))
    assert ops.purge_done(conn, table, older_than=3600.0, batch_size=100) == 0
    left = conn.execute(sql.SQL("SELECT limit_key FROM {} ORDER BY 1").format(_flow_key(table))).fetchall()
    assert left == [("busy",), ("paused",)]


def test_invariant_25_a_key_at_its_key_concurrency_waits_for_a_finish_not_a_timer(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    # Today's 17 claim runs a second came from a 50 ms recheck while a key sat at its limit:
    # the claim now records the type as at its limit (its finishes wake the claim) and
    # otherwise looks again after CAP_RECHECK (1 s).
    add(conn, 3, event_type=A, limit_key="t1")
    limits = {A: Limit(key_concurrency=1)}
    first = claim(store, conn, limits=limits)
    assert len(first.claimed) == 1
    assert first.flow_wait is not None and first.flow_wait >= CAP_RECHECK
    at_cap = sql.SQL("SELECT at_cap FROM {} WHERE event_type = %s").format(_flow(table))
    assert conn.execute(at_cap, [A]).fetchone() == (True,)
    assert Store(table).capped(conn, [A]) == frozenset({A})
    [c] = first.claimed
    assert steps.done(store, conn, c.id, c.lease_version)
    again = claim(store, conn, limits=limits)
    assert len(again.claimed) == 1
    # The concurrency of the type: the same.
    add(conn, 3, event_type=B)
    held = claim(store, conn, limits={B: Limit(concurrency=1)})
    assert held.flow_wait is not None and held.flow_wait >= CAP_RECHECK


def test_invariant_25_a_claim_with_no_limit_declared_runs_no_flow_statement(
    migrated_dsn: str, table: str
) -> None:
    store = Store(table)
    with psycopg.connect(migrated_dsn, autocommit=True, cursor_factory=Recording) as c:
        add(c, 3, event_type=A)
        steps.claim(store, c, limit=10, lease=LONG, owner="t", max_attempts=5)  # flow_ready, cached
        Recording.seen.clear()
        add(c, 3, event_type=A)
        Recording.seen.clear()
        got = steps.claim(store, c, limit=10, lease=LONG, owner="t", max_attempts=5)
        assert len(got.claimed) == 3
        flow = re.compile(rf'"?{re.escape(table)}_flow')
        touching = [q for q in Recording.seen if flow.search(q)]
        # Only the claim's first statement (its settings and now()) reads the flow tables, in
        # the same statement and without a lock: no lock, no count, no key walk, no write. (A
        # claim without scan marks reads the subscribed types first: the fan-out, invariant 28.)
        claiming = [q for q in Recording.seen if "subscription" not in q]
        assert len(touching) == 1 and touching[0] is claiming[0], touching
        assert "FOR UPDATE" not in touching[0] and "UPDATE" not in touching[0].replace("FOR UPDATE", "")
        # With a type paused, still none: the paused type is left out as that statement read it.
        ops.pause(c, table, B)
        Recording.seen.clear()
        steps.claim(store, c, limit=10, lease=LONG, owner="t", max_attempts=5)
        assert len([q for q in Recording.seen if flow.search(q)]) == 1


def test_invariant_25_the_database_clock_stepping_back_stalls_neither_marks_nor_buckets(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    # As if the previous claims ran on a host whose clock was an hour ahead (a failover to a
    # lagging one since): marks, the type's bucket and a key's bucket written an hour ahead.
    marks = ScanMarks(lookback=10.0, full_every=3600.0)
    assert claim(store, conn, marks=marks).claimed == []  # the first, full pass
    (now,) = conn.execute("SELECT now()").fetchone() or (None,)
    ahead = now + timedelta(hours=1)
    marks.pending = marks.heads = marks.expired = marks.db_now = ahead
    fresh = add(conn, 2, event_type="plain")
    assert sorted(c.id for c in claim(store, conn, marks=marks).claimed) == fresh

    rated = add(conn, 3, event_type=A)
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (event_type, tokens, refilled_at) VALUES (%s, 0, now() + interval '1 hour')"
        ).format(_flow(table)),
        [A],
    )
    keyed = add(conn, 3, event_type=B, limit_key="t1")
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (event_type, limit_key, tokens, refilled_at)"
            " VALUES (%s, 't1', 0, now() + interval '1 hour')"
        ).format(_flow_key(table)),
        [B],
    )
    limits = {A: Limit(rate=10), B: Limit(key_rate=10)}
    got: list[int] = []
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and len(got) < 2:
        got += [c.id for c in claim(store, conn, limits=limits).claimed]
        time.sleep(0.12)
    # Not stalled for the hour; not over-granted either: a token per 0.1 s at most, from now().
    types = Counter(fetch(conn, table, i)["event_type"] for i in got)
    assert types[A] >= 1 and types[B] >= 1, types
    assert types[A] <= 3 and types[B] <= 3
    assert set(got) <= set(rated) | set(keyed)


@pytest.mark.parametrize("order", [("x", "x_flow"), ("x_flow", "x"), ("x", "x_flow_key")])
def test_invariant_25_an_outbox_named_like_another_outboxs_flow_table_is_refused(
    conn: psycopg.Connection[Any], order: tuple[str, str]
) -> None:
    first, second = order
    assert migrate(conn, first)
    with pytest.raises(MigrationError, match=r"give one of them another name"):
        migrate(conn, second)
    # The first still claims with its flow control.
    add(conn, 1, table=first, event_type=A)
    ops.pause(conn, first, A)
    assert steps.claim(Store(first), conn, limit=5, lease=LONG, owner="t", max_attempts=5).claimed == []


def test_invariant_25_metrics_of_many_held_keys_stay_a_bounded_number_of_series(
    conn: psycopg.Connection[Any], table: str, migrated_dsn: str
) -> None:
    pytest.importorskip("prometheus_client")
    from outbox_celery.ops.metrics import METRIC_KEYS, OutboxCollector

    conn.execute(
        sql.SQL(
            "INSERT INTO {} (event_type, limit_key, paused, paused_until)"
            " SELECT %s, 'k' || i, i %% 2 = 0, CASE WHEN i %% 2 = 1 THEN now() + i * interval '1 second' END"
            " FROM generate_series(1, 3000) AS i"
        ).format(_flow_key(table)),
        [A],
    )
    samples = [s for family in OutboxCollector(migrated_dsn, table).collect() for s in family.samples]
    per_key = [s for s in samples if "limit_key" in s.labels]
    assert 0 < len(per_key) <= METRIC_KEYS
    totals = {s.name: s.value for s in samples if s.name.startswith("outbox_limit_keys_")}
    assert totals == {"outbox_limit_keys_paused": 1500, "outbox_limit_keys_rate_limited": 1500}


def test_invariant_25_odd_flow_state_of_one_type_fails_no_claim(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    # Buckets holding NaN or infinity (written by hand, or by a bug) are clamped where they are
    # read: every type, the unlimited ones included, is still claimed.
    add(conn, 2, event_type=A)
    add(conn, 2, event_type=B, limit_key="t1")
    others = add(conn, 2, event_type="plain")
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (event_type, tokens, refilled_at, key_cursor) VALUES (%s, 'NaN', now(), '')"
        ).format(_flow(table)),
        [A],
    )
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (event_type, limit_key, tokens, refilled_at) VALUES (%s, 't1', 'Infinity', now())"
        ).format(_flow_key(table)),
        [B],
    )
    got = claim(store, conn, limits={A: Limit(rate=10), B: Limit(key_rate=10, key_concurrency=5)})
    types = Counter(c.event_type for c in got.claimed)
    assert types["plain"] == len(others) and types[B] >= 1
