"""enqueue / enqueue_many (and their async forms) on every kind of connection a producer holds:
psycopg 3, psycopg2, SQLAlchemy Session and Connection on both drivers, psycopg AsyncConnection,
SQLAlchemy AsyncSession and AsyncConnection. Each writes and rolls back with the caller's
transaction, refuses autocommit, and takes the same key locks (invariant 9).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from typing import Any

import psycopg
import pytest

from outbox_celery import (
    Event,
    ProducerError,
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
)

from .helpers import Connect, count, fetch
from .producer_kinds import ASYNC_KINDS, BUSINESS, SYNC_KINDS

ORDER = {"event_type": "order.created", "aggregate_type": "order", "aggregate_id": "42"}


@pytest.fixture
def business(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """An observer connection (autocommit) on a database with a business table."""
    conn.execute("CREATE TABLE business (id bigserial PRIMARY KEY, note text)")
    return conn


def _counts(observer: psycopg.Connection[Any], table: str) -> tuple[int, int]:
    row = observer.execute("SELECT count(*) FROM business").fetchone()
    assert row is not None
    return count(observer, table), int(row[0])


@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_each_kind_commits_with_the_business_transaction(
    kind: str, migrated_dsn: str, business: psycopg.Connection[Any], table: str
) -> None:
    with SYNC_KINDS[kind](migrated_dsn) as h:
        h.execute(BUSINESS)
        one = enqueue(h.conn, payload={"kind": kind}, table=table, **ORDER)
        more = enqueue_many(h.conn, [Event("e", {"n": n}, "a", n) for n in range(3)], table=table)
        assert _counts(business, table) == (0, 0), "visible before commit"
        h.commit()
    assert _counts(business, table) == (4, 1)
    assert fetch(business, table, one)["payload"] == {"kind": kind}
    assert more == sorted(more) and len(set(more)) == 3


@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_each_kind_rolls_back_with_the_business_transaction(
    kind: str, migrated_dsn: str, business: psycopg.Connection[Any], table: str
) -> None:
    with SYNC_KINDS[kind](migrated_dsn) as h:
        h.execute(BUSINESS)
        enqueue(h.conn, payload={}, table=table, **ORDER)
        enqueue_many(h.conn, [Event("e", {}, "a", 1, ordered=True)], table=table)
        h.rollback()
        # The connection is usable afterwards, in a new transaction of its own.
        enqueue(h.conn, payload={"after": True}, table=table, **ORDER)
        h.commit()
    assert _counts(business, table) == (1, 0)


@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_each_kind_refuses_autocommit_unless_allowed(
    kind: str, migrated_dsn: str, business: psycopg.Connection[Any], table: str
) -> None:
    with SYNC_KINDS[kind](migrated_dsn, autocommit=True) as h:
        with pytest.raises(ProducerError, match="autocommit"):
            enqueue(h.conn, payload={}, table=table, **ORDER)
        with pytest.raises(ProducerError, match="autocommit"):
            enqueue_many(h.conn, [Event("e", {}, "a", 1)], table=table)
        assert _counts(business, table) == (0, 0)
        enqueue(h.conn, payload={}, table=table, ordered=True, allow_autocommit=True, **ORDER)
    assert _counts(business, table) == (1, 0)


def _same_key_producer(connect: Connect, table: str, done: threading.Event, out: dict[str, Any]) -> None:
    def run() -> None:
        c = connect()
        with c.transaction():
            out["id"] = enqueue(c, payload={}, table=table, ordered=True, **ORDER)
        out["at"] = time.monotonic()
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    out["thread"] = t


@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_invariant_9_each_kind_holds_its_key_until_commit(
    kind: str, migrated_dsn: str, conn: psycopg.Connection[Any], table: str, connect: Connect
) -> None:
    done = threading.Event()
    second: dict[str, Any] = {}
    with SYNC_KINDS[kind](migrated_dsn) as h:
        first = enqueue(h.conn, payload={}, table=table, ordered=True, **ORDER)
        _same_key_producer(connect, table, done, second)
        assert not done.wait(0.5), "a producer of the same key did not wait"
        committed_at = time.monotonic()
        h.commit()
    assert done.wait(10)
    second["thread"].join(10)
    assert second["at"] >= committed_at and first < second["id"]


def test_a_failed_psycopg2_transaction_is_refused(migrated_dsn: str, table: str) -> None:
    import psycopg2

    with SYNC_KINDS["psycopg2"](migrated_dsn) as h:
        with pytest.raises(psycopg2.Error):
            h.execute("SELECT 1/0")
        with pytest.raises(ProducerError, match="has failed"):
            enqueue(h.conn, payload={}, table=table, **ORDER)


def test_a_sqlalchemy_session_without_autobegin_and_transaction_is_refused(
    migrated_dsn: str, business: psycopg.Connection[Any], table: str
) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from .producer_kinds import sqlalchemy_url

    engine = create_engine(sqlalchemy_url(migrated_dsn, "psycopg"))
    try:
        with Session(engine, autobegin=False) as session:
            with pytest.raises(ProducerError, match="no transaction"):
                enqueue(session, payload={}, table=table, **ORDER)
            with session.begin():
                enqueue(session, payload={}, table=table, **ORDER)
    finally:
        engine.dispose()
    assert _counts(business, table) == (1, 0)


def test_kinds_that_do_not_fit_are_refused_by_name(migrated_dsn: str, table: str) -> None:
    async def main() -> None:
        async with ASYNC_KINDS["psycopg-async"](migrated_dsn) as h:
            with pytest.raises(ProducerError, match="enqueue_async"):
                enqueue(h.conn, payload={}, table=table, **ORDER)
        async with ASYNC_KINDS["sqlalchemy-asyncsession-psycopg"](migrated_dsn) as h:
            with pytest.raises(ProducerError, match="enqueue_async"):
                enqueue(h.conn, payload={}, table=table, **ORDER)
        with SYNC_KINDS["psycopg"](migrated_dsn) as s, pytest.raises(ProducerError, match="synchronous"):
            await enqueue_async(s.conn, payload={}, table=table, **ORDER)
        with pytest.raises(ProducerError, match="psycopg 3 Connection"):
            enqueue(object(), payload={}, table=table, **ORDER)

    asyncio.run(main())


@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_invariant_24_each_kind_writes_the_limit_key(
    kind: str, migrated_dsn: str, business: psycopg.Connection[Any], table: str
) -> None:
    with SYNC_KINDS[kind](migrated_dsn) as h:
        one = enqueue(h.conn, payload={}, table=table, limit_key="tenant-1", **ORDER)
        many = enqueue_many(
            h.conn,
            [Event("e", {}, "a", 1, limit_key="tenant-2"), {**ORDER, "payload": {}, "limit_key": "tenant-3"}],
            table=table,
        )
        h.commit()
    assert [fetch(business, table, i)["limit_key"] for i in [one, *many]] == [
        "tenant-1",
        "tenant-2",
        "tenant-3",
    ]


# -- async ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ASYNC_KINDS)
def test_each_async_kind_commits_and_rolls_back_with_the_caller(
    kind: str, migrated_dsn: str, business: psycopg.Connection[Any], table: str
) -> None:
    async def main() -> None:
        async with ASYNC_KINDS[kind](migrated_dsn) as h:
            await h.execute(BUSINESS)
            await enqueue_async(h.conn, payload={"kind": kind}, table=table, **ORDER)
            ids = await enqueue_many_async(
                h.conn, [Event("e", {"n": n}, "a", n) for n in range(3)], table=table
            )
            assert len(ids) == 3 and ids == sorted(ids)
            assert _counts(business, table) == (0, 0), "visible before commit"
            await h.rollback()
            assert _counts(business, table) == (0, 0)
            await h.execute(BUSINESS)
            one = await enqueue_async(h.conn, payload={"kind": kind}, table=table, limit_key="t", **ORDER)
            assert _counts(business, table) == (0, 0), "visible before commit"
            await h.commit()
        assert _counts(business, table) == (1, 1)
        assert fetch(business, table, one)["limit_key"] == "t"

    asyncio.run(main())


@pytest.mark.parametrize("kind", ASYNC_KINDS)
def test_each_async_kind_refuses_autocommit_unless_allowed(
    kind: str, migrated_dsn: str, business: psycopg.Connection[Any], table: str
) -> None:
    async def main() -> None:
        async with ASYNC_KINDS[kind](migrated_dsn, autocommit=True) as h:
            with pytest.raises(ProducerError, match="autocommit"):
                await enqueue_async(h.conn, payload={}, table=table, **ORDER)
            with pytest.raises(ProducerError, match="autocommit"):
                await enqueue_many_async(h.conn, [Event("e", {}, "a", 1)], table=table)
            assert _counts(business, table) == (0, 0)
            await enqueue_async(h.conn, payload={}, table=table, ordered=True, allow_autocommit=True, **ORDER)
        assert _counts(business, table) == (1, 0)

    asyncio.run(main())


@pytest.mark.parametrize("kind", ASYNC_KINDS)
def test_invariant_9_each_async_kind_holds_its_key_until_commit(
    kind: str, migrated_dsn: str, table: str, connect: Connect
) -> None:
    done = threading.Event()
    second: dict[str, Any] = {}

    async def main() -> tuple[int, float]:
        async with ASYNC_KINDS[kind](migrated_dsn) as h:
            first = await enqueue_async(h.conn, payload={}, table=table, ordered=True, **ORDER)
            _same_key_producer(connect, table, done, second)
            await asyncio.sleep(0.5)
            assert not done.is_set(), "a producer of the same key did not wait"
            committed_at = time.monotonic()
            await h.commit()
        return first, committed_at

    first, committed_at = asyncio.run(main())
    assert done.wait(10)
    second["thread"].join(10)
    assert second["at"] >= committed_at and first < second["id"]


def test_async_bad_input_is_refused_before_the_connection_is_touched() -> None:
    async def main() -> None:
        with pytest.raises(ProducerError, match="event_type must not be empty"):
            await enqueue_async(None, event_type="", payload={}, aggregate_type="a", aggregate_id=1)
        with pytest.raises(ProducerError, match="message 1"):
            await enqueue_many_async(None, [Event("e", {}, "a", 1), Event("e", float("nan"), "a", 1)])

    asyncio.run(main())


def test_optional_drivers_are_not_imported_when_unused(migrated_dsn: str, table: str) -> None:
    """SQLAlchemy, psycopg2 and OpenTelemetry are extras: a psycopg 3 producer never imports them."""
    script = (
        "import sys, psycopg, outbox_celery\n"
        "with psycopg.connect(sys.argv[1]) as c:\n"
        "    outbox_celery.enqueue(c, event_type='e', payload={}, aggregate_type='a', aggregate_id=1,"
        " table=sys.argv[2])\n"
        "print(sorted(m for m in ('sqlalchemy', 'psycopg2', 'opentelemetry') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, migrated_dsn, table], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


MIGRATE_FIRST = r"outbox table outbox does not exist .*run `outbox-celery migrate`"


@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_each_kind_says_to_migrate_when_the_table_is_missing(kind: str, dsn: str) -> None:
    """An enqueue before ``outbox-celery migrate`` says what to run, as the CLI does."""
    with SYNC_KINDS[kind](dsn) as h:
        with pytest.raises(ProducerError, match=MIGRATE_FIRST) as refused:
            enqueue(h.conn, payload={}, **ORDER)
        assert refused.value.__cause__ is not None  # the driver's own error, kept
        h.rollback()
        with pytest.raises(ProducerError, match=MIGRATE_FIRST):
            enqueue_many(h.conn, [Event("e", {}, "a", 1, ordered=True)])
        h.rollback()


@pytest.mark.parametrize("kind", ASYNC_KINDS)
def test_each_async_kind_says_to_migrate_when_the_table_is_missing(kind: str, dsn: str) -> None:
    async def scenario() -> None:
        async with ASYNC_KINDS[kind](dsn) as h:
            with pytest.raises(ProducerError, match=MIGRATE_FIRST):
                await enqueue_async(h.conn, payload={}, **ORDER)
            await h.rollback()
            with pytest.raises(ProducerError, match=MIGRATE_FIRST):
                await enqueue_many_async(h.conn, [Event("e", {}, "a", 1)])
            await h.rollback()

    asyncio.run(scenario())
