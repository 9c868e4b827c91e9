"""Transactional handlers (DESIGN invariant 20) through the dispatcher, without Celery.

The handler's writes, the events it enqueues and the fenced done commit in one transaction; a
superseded claim or any exception rolls them back. Real workers (SIGKILL, stale workers) are in
``tests/acceptance/test_celery_transactional.py``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.adapt import Loader
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool
from support import steps

from outbox_celery import (
    ConfigurationError,
    Defer,
    Message,
    OutboxConfig,
    PermanentError,
    RetryableError,
    TableName,
    enqueue,
)
from outbox_celery.claim.executor import Claimed
from outbox_celery.handlers import HandlerSpec
from outbox_celery.message import Outcome
from outbox_celery.ops import subscriptions
from outbox_celery.testing import InProcess
from outbox_celery.transactional import PsycopgTransaction

from .helpers import LONG, add, count, fetch

EVENT = "ledger.post"
FOLLOW_UP = "ledger.posted"


@pytest.fixture
def pool(migrated_dsn: str) -> Iterator[ConnectionPool[Any]]:
    with ConnectionPool(migrated_dsn, min_size=1, max_size=4, kwargs={"autocommit": True}, open=True) as p:
        yield p


@pytest.fixture
def effects(conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        "CREATE TABLE ledger (n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
        " outbox_id bigint NOT NULL, lease_version bigint NOT NULL)"
    )


def _dispatcher(
    pool: ConnectionPool[Any], table: str, handler: Callable[[Message, Any], Any], **config: Any
) -> InProcess:
    spec = HandlerSpec(EVENT, handler, "q", transaction=PsycopgTransaction())
    return InProcess(OutboxConfig(table=table, **{"lease": LONG, **config}), pool.connection, {EVENT: spec})


def _post(message: Message, conn: psycopg.Connection[Any], table: str) -> None:
    """The effect and its follow-up event, in the handler's transaction."""
    conn.execute(
        "INSERT INTO ledger (outbox_id, lease_version) VALUES (%s, %s)", [message.id, message.lease_version]
    )
    enqueue(
        conn,
        event_type=FOLLOW_UP,
        payload={"after": message.id},
        aggregate_type="ledger",
        aggregate_id=str(message.id),
        table=table,
    )


def _ledger(conn: psycopg.Connection[Any]) -> list[tuple[int, int]]:
    return [
        (int(a), int(b)) for a, b in conn.execute("SELECT outbox_id, lease_version FROM ledger ORDER BY n")
    ]


def _follow_ups(conn: psycopg.Connection[Any], table: str) -> int:
    return count(conn, table, f"event_type = '{FOLLOW_UP}'")


def _claim_one(dispatcher: InProcess, conn: psycopg.Connection[Any], lease: float = LONG) -> int:
    [c] = steps.claim(
        dispatcher.store, conn, limit=1, lease=lease, owner="w", max_attempts=5, event_types=[EVENT]
    ).claimed
    return c.lease_version


@pytest.mark.usefixtures("effects")
def test_invariant_20_effect_follow_up_and_done_commit_together(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    seen: dict[str, Any] = {}

    def handler(message: Message, tx: psycopg.Connection[Any]) -> None:
        _post(message, tx, table)
        # Inside the transaction: bounded below the lease, nothing visible outside yet.
        seen["timeouts"] = tx.execute(
            "SELECT current_setting('statement_timeout'),"
            " current_setting('idle_in_transaction_session_timeout')"
        ).fetchone()
        seen["outside"] = (fetch(conn, table, message.id)["status"], len(_ledger(conn)))

    dispatcher = _dispatcher(pool, table, handler, done_batch_delay=1.0)
    [i] = add(conn, table=table, event_type=EVENT)
    version = _claim_one(dispatcher, conn)
    # batch_done is asked for, as the delivery task does: a transactional done is never held.
    assert dispatcher.deliver(i, version, batch_done=True) == Outcome.DONE
    assert seen["timeouts"] == ("54s", "54s")  # 0.9 * lease, the delivery's time limit
    assert seen["outside"] == ("processing", 0)
    assert fetch(conn, table, i)["status"] == "done"
    assert _ledger(conn) == [(i, version)]
    assert _follow_ups(conn, table) == 1
    assert dispatcher.done_batch is not None and dispatcher.done_batch.pending() == 0
    # The pooled connection went back without the transaction's settings.
    with pool.connection() as c:
        assert c.execute("SHOW statement_timeout").fetchone() == ("0",)


@pytest.mark.usefixtures("effects")
def test_invariant_20_a_superseded_claim_rolls_back_its_effect_and_follow_up(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    dispatcher = _dispatcher(pool, table, lambda m, tx: None)
    t = TableName.parse(table).identifier()

    def handler(message: Message, tx: psycopg.Connection[Any]) -> None:
        _post(message, tx, table)
        # While it runs, its lease ends and another claim takes the row (a new fencing token).
        conn.execute(sql.SQL("UPDATE {} SET lease_until = now() WHERE id = %s").format(t), [message.id])
        assert _claim_one(dispatcher, conn) == message.lease_version + 1

    dispatcher.handlers[EVENT] = HandlerSpec(EVENT, handler, "q", transaction=PsycopgTransaction())
    [i] = add(conn, table=table, event_type=EVENT)
    version = _claim_one(dispatcher, conn)
    assert dispatcher.deliver(i, version) == Outcome.LOST_LEASE
    row = fetch(conn, table, i)
    assert (row["status"], row["lease_version"]) == ("processing", version + 1)
    assert _ledger(conn) == []
    assert _follow_ups(conn, table) == 0
    assert dispatcher.store.get_stats()["lost_leases"] == 1


@pytest.mark.usefixtures("effects")
@pytest.mark.parametrize(
    ("error", "status", "outcome"),
    [
        (RetryableError("try later", delay=30), "pending", Outcome.RETRY),
        (Defer(30, reason="not yet"), "pending", Outcome.DEFER),
        (PermanentError("never"), "dead", Outcome.DEAD),
    ],
)
def test_invariant_20_a_classified_error_rolls_the_effect_back_and_records_the_outcome(
    conn: psycopg.Connection[Any],
    table: str,
    pool: ConnectionPool[Any],
    error: Exception,
    status: str,
    outcome: Outcome,
) -> None:
    def handler(message: Message, tx: psycopg.Connection[Any]) -> None:
        _post(message, tx, table)
        raise error

    dispatcher = _dispatcher(pool, table, handler)
    [i] = add(conn, table=table, event_type=EVENT)
    assert dispatcher.deliver(i, _claim_one(dispatcher, conn)) == outcome
    row = fetch(conn, table, i)
    assert row["status"] == status
    assert row["last_error"]
    assert _ledger(conn) == []
    assert _follow_ups(conn, table) == 0


@pytest.mark.usefixtures("effects")
def test_invariant_20_an_unclassified_error_rolls_back_is_recorded_and_raised(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    def handler(message: Message, tx: psycopg.Connection[Any]) -> None:
        _post(message, tx, table)
        raise KeyError("boom")

    dispatcher = _dispatcher(pool, table, handler)
    [i] = add(conn, table=table, event_type=EVENT)
    with pytest.raises(KeyError):
        dispatcher.deliver(i, _claim_one(dispatcher, conn))
    row = fetch(conn, table, i)
    assert (row["status"], row["attempts"]) == ("pending", 1)  # a failed attempt, as a plain handler's
    assert "KeyError" in row["last_error"]
    assert _ledger(conn) == []


def test_invariant_20_a_serialization_failure_or_deadlock_is_retried(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    def handler(message: Message, tx: psycopg.Connection[Any]) -> None:
        tx.execute("DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = 'deadlock_detected'; END $$")

    dispatcher = _dispatcher(pool, table, handler)
    [i] = add(conn, table=table, event_type=EVENT)
    assert dispatcher.deliver(i, _claim_one(dispatcher, conn)) == Outcome.RETRY
    row = fetch(conn, table, i)
    assert (row["status"], row["attempts"]) == ("pending", 1)
    assert "transaction conflict (40P01)" in row["last_error"]


def test_invariant_20_the_transaction_is_bounded_below_the_lease(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    # Lease 2 s: every statement and every idle moment of the transaction is bounded by 1.8 s.
    def slow_statement(message: Message, tx: psycopg.Connection[Any]) -> None:
        tx.execute("SELECT pg_sleep(5)")

    def idle(message: Message, tx: psycopg.Connection[Any]) -> None:
        tx.execute("SELECT 1")
        time.sleep(2.5)
        tx.execute("SELECT 1")

    for handler, error in (
        (slow_statement, psycopg.errors.QueryCanceled),
        (idle, psycopg.errors.IdleInTransactionSessionTimeout),
    ):
        dispatcher = _dispatcher(pool, table, handler, lease=2.0, claim_interval=0.5)
        [i] = add(conn, table=table, event_type=EVENT)
        started = time.monotonic()
        # PostgreSQL 17+ also sets transaction_timeout to the same bound: whichever fires first.
        expected: tuple[type[BaseException], ...] = (error,)
        if conn.info.server_version >= 170000:
            expected += (psycopg.errors.TransactionTimeout,)
        with pytest.raises(expected):
            dispatcher.deliver(i, _claim_one(dispatcher, conn, lease=2.0))
        assert time.monotonic() - started < 4.0
        assert fetch(conn, table, i)["status"] == "pending"  # a failed attempt (invariant 31)


@pytest.mark.usefixtures("effects")
def test_invariant_20_the_lease_heartbeat_keeps_a_long_transaction_its_claim(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    # Lease 2 s, a transaction of 3 s: the heartbeat extends the lease on a connection of its
    # own (the transaction touches the row only with its final done), no claim takes the row
    # meanwhile, and the transaction's bound is handler_time_limit (default 10 leases).
    reclaimed: list[int] = []

    def handler(message: Message, tx: psycopg.Connection[Any]) -> None:
        _post(message, tx, table)
        for _ in range(6):
            tx.execute("SELECT pg_sleep(0.5)")
            reclaimed.extend(
                c.id
                for c in steps.claim(
                    dispatcher.store,
                    conn,
                    limit=5,
                    lease=2.0,
                    owner="thief",
                    max_attempts=5,
                    event_types=[EVENT],
                ).claimed
            )

    dispatcher = _dispatcher(pool, table, handler, lease=2.0, claim_interval=0.5, lease_heartbeat=True)
    [i] = add(conn, table=table, event_type=EVENT)
    version = _claim_one(dispatcher, conn, lease=2.0)
    assert dispatcher.deliver(i, version) == Outcome.DONE
    assert reclaimed == []
    assert fetch(conn, table, i)["status"] == "done"
    assert _ledger(conn) == [(i, version)]


def test_invariant_20_an_ordered_done_moves_the_head_in_the_same_transaction(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    seen: list[bool] = []

    def handler(message: Message, tx: psycopg.Connection[Any]) -> None:
        if message.id == first:
            seen.append(bool(fetch(conn, table, second)["head"]))

    dispatcher = _dispatcher(pool, table, handler)
    first, second = add(conn, 2, table=table, event_type=EVENT, key="acct-1")
    assert dispatcher.deliver(first, _claim_one(dispatcher, conn)) == Outcome.DONE
    assert seen == [False]
    assert fetch(conn, table, second)["head"] is True
    # The next claim takes the new head, as after a plain handler's done.
    assert dispatcher.deliver(second, _claim_one(dispatcher, conn)) == Outcome.DONE
    assert count(conn, table, "status = 'done'") == 2


# -- the connection a handler used (invariant 20) ------------------------------------------------

# What a later user of a pooled connection reads: all of it is the session's default unless a
# handler's session state survived its run.
SESSION_STATE = (
    "SELECT nullif(current_setting('app.tenant', true), ''), current_setting('synchronous_commit'),"
    " (SELECT count(*) FROM pg_cursors)::int, (SELECT count(*) FROM pg_listening_channels())::int,"
    " (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 4242)::int,"
    " to_regclass('pg_temp.leak') IS NULL, 'plain'::text"
)
# (A reset leaves a custom setting that was set empty rather than unknown, hence the nullif.)
CLEAN = (None, "on", 0, 0, 0, True, "plain")


class _Shout(Loader):
    """A text loader a handler registers on its connection (an adapter that must not outlive it)."""

    def load(self, data: Any) -> str:
        return bytes(data).decode().upper()


def _leave_state(tx: psycopg.Connection[Any], *, python_side: bool = True) -> None:
    """Everything a handler can leave on its connection: the issue's examples and more."""
    tx.execute("SET app.tenant = '42'")
    tx.execute("SET synchronous_commit = off")
    tx.execute("LISTEN outbox_leak")
    tx.execute("DECLARE leak CURSOR WITH HOLD FOR SELECT 1")
    tx.execute("SELECT pg_advisory_lock(4242)")
    tx.execute("CREATE TEMP TABLE leak (x int)")
    if python_side:
        tx.adapters.register_loader("text", _Shout)
        tx.row_factory = dict_row  # type: ignore[assignment]


def _publish_into(claims: list[Claimed]) -> Callable[[Any], int]:
    def publish(batch: Any) -> int:
        claims.extend(batch)
        return len(batch)

    return publish


@pytest.mark.usefixtures("effects")
@pytest.mark.parametrize(
    ("ends", "python_side"), [("returns", False), ("raises", False), ("returns", True), ("raises", True)]
)
def test_invariant_20_a_handler_s_session_state_never_reaches_a_later_user_of_its_connection(
    conn: psycopg.Connection[Any],
    table: str,
    migrated_dsn: str,
    ends: str,
    python_side: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Two pooled connections: every later claim, start, finalizer and run meets the one the
    # leaking handler used, unless it was discarded.
    seen: list[tuple[Any, ...]] = []
    used: list[psycopg.Connection[Any]] = []

    def handler(message: Message, tx: psycopg.Connection[Any]) -> None:
        used.append(tx)
        if len(used) == 1:
            _post(message, tx, table)
            _leave_state(tx, python_side=python_side)
            if ends == "raises":
                raise RetryableError("after leaving state", delay=0)
        else:
            seen.append(tx.execute(SESSION_STATE).fetchone() or ())

    with ConnectionPool(migrated_dsn, min_size=2, max_size=2, kwargs={"autocommit": True}, open=True) as pool:
        dispatcher = _dispatcher(pool, table, handler)
        dispatcher.handlers[FOLLOW_UP] = HandlerSpec(
            FOLLOW_UP, lambda m, tx: None, "q", transaction=PsycopgTransaction()
        )
        first, second = add(conn, 2, table=table, event_type=EVENT)
        claims: list[Claimed] = []
        assert dispatcher.claim_and_publish(_publish_into(claims)).claimed == 2
        versions = {c.id: c.lease_version for c in claims}
        expected = Outcome.DONE if ends == "returns" else Outcome.RETRY
        assert dispatcher.deliver(first, versions[first]) == expected
        # Later claims (tuple rows, the connection's own row factory), starts and finalizers
        # run on the pool's connections: none meets the handler's row factory or settings.
        claims.clear()
        dispatcher.claim_and_publish(_publish_into(claims))
        assert dispatcher.deliver(second, versions[second]) == Outcome.DONE
        assert seen == [CLEAN]
        with pool.connection() as a, pool.connection() as b:
            assert [c.execute(SESSION_STATE).fetchone() for c in (a, b)] == [CLEAN, CLEAN]
        # The server side is reset on the connection; a changed Python side has it discarded.
        assert used[0].closed is python_side
    assert fetch(conn, table, second)["status"] == "done"
    # The pool's warning about a closed connection given back is not one per run.
    assert [
        r.getMessage() for r in caplog.records if r.name == "psycopg.pool" and r.levelno >= logging.WARNING
    ] == []


# -- a run that rolled back (invariant 20) ------------------------------------------------------


def _rollback(tx: psycopg.Connection[Any]) -> None:
    raise psycopg.Rollback  # psycopg's transaction() rolls back and swallows it


def _raw_rollback(tx: psycopg.Connection[Any]) -> None:
    tx.execute("ROLLBACK")


def _swallowed_error(tx: psycopg.Connection[Any]) -> None:
    with contextlib.suppress(psycopg.errors.DivisionByZero):
        tx.execute("SELECT 1 / 0")


@pytest.mark.usefixtures("effects")
@pytest.mark.parametrize(
    ("ends", "says"),
    [
        (_rollback, "rolled back its transaction (psycopg.Rollback); nothing it wrote was committed"),
        (_raw_rollback, "ended its transaction itself (a COMMIT or ROLLBACK on its connection)"),
        (_swallowed_error, "could only roll back; nothing it wrote was committed"),
    ],
)
def test_invariant_20_a_handler_that_rolls_back_is_a_retryable_failure_not_done(
    conn: psycopg.Connection[Any],
    table: str,
    pool: ConnectionPool[Any],
    ends: Callable[[psycopg.Connection[Any]], None],
    says: str,
) -> None:
    def handler(message: Message, tx: psycopg.Connection[Any]) -> None:
        _post(message, tx, table)
        if message.attempts == 1:
            ends(tx)

    dispatcher = _dispatcher(pool, table, handler, max_attempts=2)
    [i] = add(conn, table=table, event_type=EVENT)
    assert dispatcher.deliver(i, _claim_one(dispatcher, conn)) == Outcome.RETRY
    row = fetch(conn, table, i)
    # Nothing committed, and it says so: back after a backoff, no lease left to run out.
    assert (row["status"], row["attempts"], row["lease_until"]) == ("pending", 1, None)
    assert says in row["last_error"]
    assert (_ledger(conn), _follow_ups(conn, table)) == ([], 0)
    # The next run commits, once: a healthy message never ends dead from a rollback.
    t = TableName.parse(table).identifier()
    conn.execute(sql.SQL("UPDATE {} SET available_at = now() WHERE id = %s").format(t), [i])
    version = _claim_one(dispatcher, conn)
    assert dispatcher.deliver(i, version) == Outcome.DONE
    assert fetch(conn, table, i)["status"] == "done"
    assert _ledger(conn) == [(i, version)]


# -- a long transaction's follow-ups and next head (invariants 18, 20) ----------------------------


@pytest.mark.parametrize("subscribed", [False, True], ids=["one handler", "two subscriptions"])
def test_invariant_18_a_long_transactional_handler_s_follow_ups_and_next_head_are_claimed_at_once(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any], subscribed: bool
) -> None:
    # With two subscriptions of the follow-up's type (invariant 28), both of its rows move.
    # scan_lookback 1 s, a handler of 2.5 s; no full pass for an hour. While the handler runs, a
    # claim finds nothing due and moves its marks to its now(): before the fix its follow-up
    # (available_at = the transaction's start) and the key's next head (greatest(available_at,
    # now()) in the done's transaction) committed 2.5 s behind those marks, 1.5 s past lookback.
    claims: list[Claimed] = []
    follow_ups: list[int] = []

    def handler(message: Message, tx: psycopg.Connection[Any]) -> None:
        if message.id != first:
            return
        for delay in (None, 3600.0):
            follow_ups.append(
                enqueue(
                    tx,
                    event_type=FOLLOW_UP,
                    payload={"after": message.id},
                    aggregate_type="ledger",
                    aggregate_id=str(message.id),
                    delay=delay,
                    table=table,
                )
            )
        tx.execute("SELECT pg_sleep(2.5)")
        assert dispatcher.claim_and_publish(_publish_into(claims)).claimed == 0

    dispatcher = _dispatcher(pool, table, handler, scan_lookback=1.0, full_scan_interval=3600.0)
    routes = [FOLLOW_UP]
    if subscribed:
        routes = [f"{FOLLOW_UP}@{name}" for name in ("x", "y")]
        subscriptions.register(conn, table, routes)
    for route in routes:
        dispatcher.handlers[route] = HandlerSpec(route, handler, "q", transaction=PsycopgTransaction())
    first, second = add(conn, 2, table=table, event_type=EVENT, key="acct-1")
    assert dispatcher.claim_and_publish(_publish_into(claims)).claimed == 1  # the first claim: a full pass
    [c] = claims
    claims.clear()
    assert dispatcher.deliver(first, c.lease_version) == Outcome.DONE
    assert dispatcher.claim_and_publish(_publish_into(claims)).claimed == 1 + len(routes)
    assert sorted(c.event_type for c in claims) == sorted([EVENT, *routes])
    assert {second, follow_ups[0]} <= {c.id for c in claims}
    # The delayed follow-up keeps its delay (from the transaction's start).
    assert fetch(conn, table, follow_ups[1])["available_in"] > 3590


# -- SQLAlchemy --------------------------------------------------------------------------------


@pytest.fixture
def session_factory(migrated_dsn: str) -> Iterator[Any]:
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import sessionmaker

    engine = sqlalchemy.create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(migrated_dsn))
    yield sessionmaker(engine)
    engine.dispose()


def _session_post(message: Message, session: Any, table: str) -> None:
    from sqlalchemy import text

    session.execute(
        text("INSERT INTO ledger (outbox_id, lease_version) VALUES (:id, :v)"),
        {"id": message.id, "v": message.lease_version},
    )
    enqueue(
        session,
        event_type=FOLLOW_UP,
        payload={"after": message.id},
        aggregate_type="ledger",
        aggregate_id=str(message.id),
        table=table,
    )


@pytest.mark.usefixtures("effects")
def test_invariant_20_sqlalchemy_session_effect_follow_up_and_done_commit_together(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any], session_factory: Any
) -> None:
    from outbox_celery.transactional import SqlAlchemyTransaction

    def handler(message: Message, session: Any) -> None:
        _session_post(message, session, table)
        if message.attempts == 1:
            raise RetryableError("once", delay=0)

    spec = HandlerSpec(EVENT, handler, "q", transaction=SqlAlchemyTransaction(session_factory))
    dispatcher = InProcess(OutboxConfig(table=table, lease=LONG), pool.connection, {EVENT: spec})
    [i] = add(conn, table=table, event_type=EVENT)
    assert dispatcher.deliver(i, _claim_one(dispatcher, conn)) == Outcome.RETRY
    assert (_ledger(conn), _follow_ups(conn, table)) == ([], 0)
    version = _claim_one(dispatcher, conn)
    assert dispatcher.deliver(i, version) == Outcome.DONE
    assert fetch(conn, table, i)["status"] == "done"
    assert _ledger(conn) == [(i, version)]
    assert _follow_ups(conn, table) == 1


def test_invariant_20_an_ordered_message_is_refused_outside_read_committed(
    conn: psycopg.Connection[Any], table: str, migrated_dsn: str
) -> None:
    # The ordered done decides the key's next head from a snapshot taken after the key lock:
    # only under read committed (invariant 9). The handler is not called.
    called: list[int] = []
    options = {"autocommit": True, "options": "-c default_transaction_isolation=repeatable\\ read"}
    with ConnectionPool(migrated_dsn, min_size=1, max_size=2, kwargs=options, open=True) as rr:
        dispatcher = _dispatcher(rr, table, lambda m, tx: called.append(m.id))
        [i] = add(conn, table=table, event_type=EVENT, key="acct-1")
        with pytest.raises(ConfigurationError, match="READ COMMITTED"):
            dispatcher.deliver(i, _claim_one(dispatcher, conn))
    assert called == []
    row = fetch(conn, table, i)
    # The library's failure, not the handler's: retried after a backoff, said so.
    assert row["status"] == "pending"
    assert "handler did not run" in row["last_error"] and "repeatable read" in row["last_error"]


@pytest.mark.usefixtures("effects")
def test_invariant_20_a_sqlalchemy_handler_s_session_state_never_reaches_the_engine_s_next_user(
    conn: psycopg.Connection[Any], table: str, migrated_dsn: str
) -> None:
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy import text
    from sqlalchemy.orm import sessionmaker

    from outbox_celery.transactional import SqlAlchemyTransaction

    # One pooled connection in the engine: its next user gets the handler's unless discarded.
    engine = sqlalchemy.create_engine(
        "postgresql+psycopg://", creator=lambda: psycopg.connect(migrated_dsn), pool_size=1, max_overflow=0
    )
    factory = sessionmaker(engine)

    def handler(message: Message, session: Any) -> None:
        _session_post(message, session, table)
        _leave_state(session.connection().connection.driver_connection)

    spec = HandlerSpec(EVENT, handler, "q", transaction=SqlAlchemyTransaction(factory))
    with ConnectionPool(migrated_dsn, min_size=1, max_size=2, kwargs={"autocommit": True}, open=True) as pool:
        dispatcher = InProcess(OutboxConfig(table=table, lease=LONG), pool.connection, {EVENT: spec})
        [i] = add(conn, table=table, event_type=EVENT)
        version = _claim_one(dispatcher, conn)
        assert dispatcher.deliver(i, version) == Outcome.DONE
    try:
        with factory() as session:
            assert tuple(session.execute(text(SESSION_STATE)).one()) == CLEAN
    finally:
        engine.dispose()
    assert fetch(conn, table, i)["status"] == "done"
    assert (_ledger(conn), _follow_ups(conn, table)) == ([(i, version)], 1)


@pytest.mark.usefixtures("effects")
def test_invariant_20_a_sqlalchemy_handler_that_raises_rollback_is_a_retryable_failure(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any], session_factory: Any
) -> None:
    from outbox_celery.transactional import SqlAlchemyTransaction

    def handler(message: Message, session: Any) -> None:
        _session_post(message, session, table)
        raise psycopg.Rollback

    spec = HandlerSpec(EVENT, handler, "q", transaction=SqlAlchemyTransaction(session_factory))
    dispatcher = InProcess(OutboxConfig(table=table, lease=LONG), pool.connection, {EVENT: spec})
    [i] = add(conn, table=table, event_type=EVENT)
    assert dispatcher.deliver(i, _claim_one(dispatcher, conn)) == Outcome.RETRY
    row = fetch(conn, table, i)
    assert (row["status"], row["lease_until"]) == ("pending", None)
    assert "rolled back its transaction (psycopg.Rollback)" in row["last_error"]
    assert (_ledger(conn), _follow_ups(conn, table)) == ([], 0)
