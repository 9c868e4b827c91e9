"""Liveness of the store (DESIGN invariants 10, 12, 16): lost tasks, unroutable event types.

A claim whose task never started (lost in the broker, expired in a queue, sent to a queue with no
consumer) is given back with a growing delay and no attempt spent; a claim that started and whose
worker died is re-claimed at once; an expired lease of an event type the claimer has no handler
for goes back to pending as unroutable instead of staying processing for good.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool
from support import steps
from support.tcp_proxy import ReplyCuttingProxy

from outbox_celery import OutboxConfig, RetryableError, Store, migrate
from outbox_celery.handlers import HandlerSpec
from outbox_celery.message import Outcome
from outbox_celery.testing import InProcess, temporary_database

from .helpers import LONG, PAST_SHORT, SHORT, add, claim_ids, fetch


def _claim(store: Store, conn: psycopg.Connection[Any], **kw: Any) -> Any:
    params: dict[str, Any] = {"limit": 10, "lease": SHORT, "owner": "w", "max_attempts": 3}
    return steps.claim(store, conn, **{**params, **kw})


def test_invariant_16_the_in_flight_count_holds_live_leases_only(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    add(conn, 5, table=table)
    _claim(store, conn, limit=2, lease=SHORT)
    _claim(store, conn, limit=3, lease=LONG)
    assert store.in_flight(conn) == 5
    time.sleep(PAST_SHORT)
    assert store.in_flight(conn) == 3


def test_invariant_16_expired_leases_come_back_even_when_no_new_claim_is_allowed(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    # A full bound means limit=0: no new rows, but the expired leases are still taken back.
    [started_row, lost_row] = add(conn, 2, table=table)
    claims = _claim(store, conn).claimed
    assert steps.start(store, conn, started_row, claims[0].lease_version, lease=SHORT, max_attempts=3)
    [fresh] = add(conn, table=table)
    time.sleep(PAST_SHORT)
    result = _claim(store, conn, limit=0, expired_limit=10, lease=LONG)
    assert [c.id for c in result.claimed] == [started_row]
    assert result.lost == 1
    assert fetch(conn, table, lost_row)["status"] == "pending"
    assert fetch(conn, table, fresh)["status"] == "pending"


def test_invariant_10_a_lost_claim_comes_back_unspent_and_a_started_one_with_its_attempt(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [crashed, lost] = add(conn, 2, table=table)
    claims = {c.id: c for c in _claim(store, conn).claimed}
    # The worker starts "crashed" and dies mid-handler; "lost"'s task never reaches a worker.
    assert steps.start(store, conn, crashed, claims[crashed].lease_version, lease=SHORT, max_attempts=3)
    time.sleep(PAST_SHORT)
    # Both are claimed again when their lease ends: "lost" given back first, a first loss
    # (invariant 16), with no attempt spent.
    result = _claim(store, conn, lease=LONG)
    assert sorted((c.id, c.lease_version) for c in result.claimed) == [(crashed, 2), (lost, 2)]
    assert (result.lost, result.unroutable) == (1, 0)
    row = fetch(conn, table, lost)
    assert (row["status"], row["attempts"], row["lease_version"], row["started_version"]) == (
        "processing",
        0,
        2,
        0,
    )
    assert fetch(conn, table, crashed)["attempts"] == 1
    assert store.get_stats()["lost_tasks"] == 1


def test_invariant_9_a_lost_ordered_head_keeps_its_place_and_its_successor_waits(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    a = add(conn, 2, table=table, key="A")
    assert claim_ids(store, conn, lease=SHORT) == [a[0]]
    time.sleep(PAST_SHORT)
    # A first loss: given back and claimed again by the same run, still the key's head.
    result = _claim(store, conn)
    assert (result.lost, [c.id for c in result.claimed]) == (1, [a[0]])
    assert fetch(conn, table, a[1])["lease_version"] == 0
    # A second one waits a lease (invariant 16), and its successor waits behind it.
    time.sleep(PAST_SHORT)
    assert _claim(store, conn).lost == 1
    assert claim_ids(store, conn) == []
    assert fetch(conn, table, a[1])["lease_version"] == 0
    time.sleep(SHORT + 0.05)
    assert claim_ids(store, conn) == [a[0]]


def test_invariant_10_an_expired_lease_of_an_event_type_without_handler_goes_back_as_unroutable(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    # A deploy removed the handler of "gone.event" while one of its rows was being handled.
    [gone] = add(conn, table=table, event_type="gone.event")
    [kept] = add(conn, table=table, event_type="kept.event")
    claims = {c.id: c for c in _claim(store, conn, event_types=["gone.event", "kept.event"]).claimed}
    for c in claims.values():
        assert steps.start(store, conn, c.id, c.lease_version, lease=SHORT, max_attempts=3)
    time.sleep(PAST_SHORT)
    result = _claim(store, conn, event_types=["kept.event"], unroutable_delay=LONG, lease=LONG)
    assert [c.id for c in result.claimed] == [kept]
    assert (result.unroutable, result.lost) == (1, 0)
    row = fetch(conn, table, gone)
    assert (row["status"], row["attempts"], row["lease_until"]) == ("pending", 1, None)
    assert row["last_error"].startswith("unroutable: no handler for event type 'gone.event'")
    assert LONG - 1 < row["available_in"] <= LONG
    # Not claimed by this claimer, and never reaped to dead.
    assert _claim(store, conn, event_types=["kept.event"]).claimed == []
    assert fetch(conn, table, gone)["status"] == "pending"
    assert store.get_stats()["unroutable"] == 1


def test_invariant_10_a_lost_claim_of_an_unroutable_event_type_also_goes_back_as_unroutable(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [gone] = add(conn, table=table, event_type="gone.event")
    assert claim_ids(store, conn, lease=SHORT) == [gone]
    time.sleep(PAST_SHORT)
    result = _claim(store, conn, event_types=["kept.event"], unroutable_delay=LONG)
    assert (result.unroutable, result.lost) == (1, 0)
    row = fetch(conn, table, gone)
    assert row["status"] == "pending"
    assert row["last_error"].startswith("unroutable:")


def test_invariant_12_release_never_touches_a_claim_whose_fenced_start_has_run(
    conn: psycopg.Connection[Any], store: Store, table: str, connect: Any
) -> None:
    # The publish raised although the broker had taken the task, and a worker started it: the
    # claim run's release must leave the row to that worker (invariant 4: its fence holds).
    [started_row, unsent] = add(conn, 2, table=table)
    claims = _claim(store, conn, lease=LONG).claimed
    worker = connect()
    msg = steps.start(store, worker, started_row, claims[0].lease_version, lease=LONG, max_attempts=3)
    assert msg is not None
    assert steps.release(store, conn, claims) == 1
    row = fetch(conn, table, started_row)
    assert (row["status"], row["attempts"], row["lease_version"]) == ("processing", 1, 1)
    assert fetch(conn, table, unsent)["status"] == "pending"
    # Not claimable again while its handler runs, and its worker's finalize wins.
    assert claim_ids(store, conn) == [unsent]
    assert steps.done(store, worker, started_row, claims[0].lease_version).applied


def _terminate(admin: psycopg.Connection[Any], pid: int) -> None:
    """End backend ``pid`` and wait until PostgreSQL no longer lists it."""
    admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    deadline = time.monotonic() + 10
    while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone():
        assert time.monotonic() < deadline, f"backend {pid} did not end"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("behaviour", "outcome", "status"), [("ok", Outcome.DONE, "done"), ("retry", Outcome.RETRY, "pending")]
)
def test_invariant_4_a_finalize_on_a_connection_the_server_closed_is_retried_once_on_a_fresh_one(
    migrated_dsn: str,
    conn: psycopg.Connection[Any],
    table: str,
    connect: Any,
    behaviour: str,
    outcome: str,
    status: str,
) -> None:
    # The pool holds one connection: the start and the finalize use it. While the handler runs,
    # its backend is terminated (as a PostgreSQL restart or failover would while it sits idle in
    # the pool). The fenced finalize fails on it, and is retried on a fresh connection: the
    # outcome is recorded now instead of being lost until the lease ends.
    [i] = add(conn, table=table)
    admin = connect()
    seen: list[int] = []
    with ConnectionPool(migrated_dsn, min_size=1, max_size=1, kwargs={"autocommit": True}, open=True) as pool:

        def handler(message: Any) -> None:
            with pool.connection() as c:
                seen.append(c.info.backend_pid)
            _terminate(admin, seen[0])
            if behaviour == "retry":
                raise RetryableError("HTTP 503", delay=60)

        config = OutboxConfig(table=table, lease=LONG)
        dispatcher = InProcess(
            config, pool.connection, {"thing.happened": HandlerSpec("thing.happened", handler, "q")}
        )
        [c] = steps.claim(dispatcher.store, conn, limit=1, lease=LONG, owner="w", max_attempts=5).claimed
        assert dispatcher.deliver(i, c.lease_version) == outcome
        with pool.connection() as c2:
            assert c2.info.backend_pid != seen[0]
    row = fetch(conn, table, i)
    assert (row["status"], row["attempts"]) == (status, 1)
    assert "lost_leases" not in dispatcher.store.get_stats()


def test_invariant_11_one_message_has_one_idempotency_key_however_the_table_is_spelled(
    conn: psycopg.Connection[Any], table: str, connect: Any
) -> None:
    # "outbox" and "public.outbox" are one table: before, they gave "outbox:42" and
    # "public.outbox:42", so a receiver de-duplicating on the key saw two messages.
    keys = []
    for spelling in ("outbox", "public.outbox"):
        store = Store(spelling)
        [i] = add(conn, table=table)
        [c] = steps.claim(store, conn, limit=1, lease=LONG, owner="w", max_attempts=3).claimed
        msg = steps.start(store, conn, c.id, c.lease_version, lease=LONG, max_attempts=3)
        assert msg is not None
        keys.append(msg.idempotency_key)
        assert msg.idempotency_key == f"{store.instance(conn)}/public.outbox:{i}"
    # Resolved by PostgreSQL, search_path included.
    other = connect()
    migrate(other, "events.outbox")
    other.execute("SET search_path = events")
    assert Store("outbox").canonical_name(other) == "events.outbox"
    migrate(conn, "events.Out Box")
    assert Store("events.Out Box").canonical_name(conn) == "events.Out Box"


def _proxied(dsn: str, port: int) -> str:
    """``dsn`` reaching its server through a local proxy listening on ``port``."""
    params = conninfo_to_dict(dsn)
    params.update(host="127.0.0.1", port=str(port))
    return make_conninfo(**params)


def test_invariant_3_a_start_whose_reply_was_lost_is_retried_without_counting_again_nor_going_dead(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    # The message's second and last attempt (max_attempts=2): its fenced start commits on the
    # server and the reply is lost with the connection. The dispatcher retries the start once on
    # a fresh connection; that retry must see its own start, return the message without counting
    # an attempt more, and run the handler; judged by the attempt it had just counted, it would
    # see attempts = max_attempts and make a healthy message dead without its last run.
    [i] = add(conn, table=table)
    store = Store(table)
    [c] = steps.claim(store, conn, limit=1, lease=SHORT, owner="w", max_attempts=2).claimed
    assert steps.start(store, conn, i, c.lease_version, lease=SHORT, max_attempts=2) is not None
    time.sleep(PAST_SHORT)
    [c] = steps.claim(store, conn, limit=1, lease=LONG, owner="w", max_attempts=2).claimed
    runs: list[int] = []
    server = conninfo_to_dict(migrated_dsn)
    with ReplyCuttingProxy((str(server.get("host", "127.0.0.1")), int(server.get("port", 5432)))) as proxy:
        dsn = _proxied(migrated_dsn, proxy.port)
        with ConnectionPool(dsn, min_size=1, max_size=1, kwargs={"autocommit": True}, open=True) as pool:
            config = OutboxConfig(table=table, lease=LONG, max_attempts=2)
            dispatcher = InProcess(
                config,
                pool.connection,
                {"thing.happened": HandlerSpec("thing.happened", lambda m: runs.append(m.attempts), "q")},
            )
            proxy.cut_after(b"started_version = lease_version")
            assert dispatcher.deliver(i, c.lease_version) == Outcome.DONE
        assert proxy.cuts == 1
    assert runs == [2]
    row = fetch(conn, table, i)
    assert (row["status"], row["attempts"]) == ("done", 2)


def test_invariant_11_two_databases_with_the_default_table_never_send_the_same_key(
    server_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    # Two services using the default table in two databases (or clusters) sent
    # "public.outbox:1" both; one receiver's inbox dropped the second service's message as a
    # duplicate. The table's identity (migration 0006) now tells them apart, and stays put.
    keys = []
    with temporary_database(server_dsn) as other_dsn, psycopg.connect(other_dsn, autocommit=True) as other:
        migrate(other, table)
        for c in (conn, other):
            store = Store(table)
            [i] = add(c, table=table)
            [claimed] = steps.claim(store, c, limit=1, lease=LONG, owner="w", max_attempts=3).claimed
            msg = steps.start(store, c, i, claimed.lease_version, lease=LONG, max_attempts=3)
            assert msg is not None
            keys.append(msg.idempotency_key)
        assert keys[0] != keys[1]
        assert keys[0].endswith("/public.outbox:1") and keys[1].endswith("/public.outbox:1")
        # The same key again from a fresh Store (another process), and after migrate again.
        for c, key in zip((conn, other), keys, strict=True):
            migrate(c, table)
            assert Store(table).key_prefix(c) + "1" == key
