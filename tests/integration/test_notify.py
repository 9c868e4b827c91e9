"""Push, producer side: what enqueue signals, on which channel, and when."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from outbox_celery import Event, Store, enqueue, enqueue_many, migrate

from .helpers import Connect

ORDER = {"event_type": "order.created", "aggregate_type": "order", "aggregate_id": "42", "payload": {}}


def _listen(conn: psycopg.Connection[Any], table: str) -> str:
    return Store(table).listen(conn)


def _received(conn: psycopg.Connection[Any], wait: float = 0.3) -> list[str]:
    """Channels of the notifications that arrive within ``wait`` seconds."""
    return [n.channel for n in conn.notifies(timeout=wait)]


def test_one_notification_per_transaction_and_only_at_commit(
    conn: psycopg.Connection[Any], table: str, connect: Connect
) -> None:
    listener = connect()
    channel = _listen(listener, table)
    with conn.transaction():
        enqueue(conn, table=table, **ORDER)
        enqueue(conn, table=table, **ORDER)
        enqueue_many(conn, [Event(**ORDER), Event(**ORDER)], table=table)
        assert _received(listener) == [], "notified before commit"
    # PostgreSQL folds identical notifications of one transaction: three calls, one wake-up.
    assert _received(listener) == [channel]
    with conn.transaction(force_rollback=True):
        enqueue(conn, table=table, **ORDER)
    assert _received(listener) == [], "a rolled-back enqueue must not wake anyone"


def test_notify_false_sends_nothing(conn: psycopg.Connection[Any], table: str, connect: Connect) -> None:
    listener = connect()
    _listen(listener, table)
    with conn.transaction():
        enqueue(conn, table=table, notify=False, **ORDER)
        enqueue_many(conn, [Event(**ORDER)], table=table, notify=False)
    assert _received(listener) == []


def test_another_tables_notifications_do_not_wake_this_one(
    conn: psycopg.Connection[Any], table: str, connect: Connect, migrated_dsn: str
) -> None:
    migrate(conn, "events.other")
    listener = connect()
    mine = _listen(listener, table)
    with conn.transaction():
        enqueue(conn, table="events.other", **ORDER)
    assert _received(listener) == []
    with conn.transaction():
        enqueue(conn, table=table, **ORDER)
    assert _received(listener) == [mine]


def test_channel_is_named_after_the_table_oid_whatever_the_spelling(
    conn: psycopg.Connection[Any], table: str
) -> None:
    oid = conn.execute(
        sql.SQL("SELECT {}::regclass::oid").format(sql.Literal(Store(table).table.qualified))
    ).fetchone()
    assert oid is not None
    assert Store(table).notify_channel(conn) == f"outbox_celery_{oid[0]}"
    assert Store(f"public.{table}").notify_channel(conn) == f"outbox_celery_{oid[0]}"


def test_a_table_name_that_needs_quoting_gets_a_plain_channel(
    conn: psycopg.Connection[Any], connect: Connect
) -> None:
    weird = 'Out"box; LISTEN x'.replace('"', "")  # quotes are refused by TableName itself
    migrate(conn, weird)
    listener = connect()
    channel = _listen(listener, weird)
    assert channel.startswith("outbox_celery_") and channel[len("outbox_celery_") :].isdigit()
    with conn.transaction():
        enqueue(conn, table=weird, **ORDER)
    assert _received(listener) == [channel]


def test_next_due_reports_delayed_rows_in_database_seconds(conn: psycopg.Connection[Any], table: str) -> None:
    store = Store(table)
    assert store.next_due(conn, ["order.created"]) is None
    with conn.transaction():
        enqueue(conn, table=table, delay=30, **ORDER)
        enqueue(conn, table=table, delay=5, **{**ORDER, "event_type": "not.mine"})
    due = store.next_due(conn, ["order.created"])
    assert due is not None and 25 < due <= 30
    due_any = store.next_due(conn, None)
    assert due_any is not None and 0 < due_any <= 5


def test_invariant_13_next_due_reports_delayed_and_backed_off_ordered_heads(
    conn: psycopg.Connection[Any], table: str
) -> None:
    # next_due read the unordered pending rows only, so a delayed or backed-off
    # ordered head woke the listener at listen_poll instead of when due (docs/push.md). Only a
    # head counts: the messages behind it wait for it, not for the clock.
    store = Store(table)
    with conn.transaction():
        enqueue(conn, table=table, delay=20, ordered=True, **ORDER)
        enqueue(conn, table=table, delay=5, ordered=True, **ORDER)  # behind the head: not due
        enqueue(
            conn,
            table=table,
            delay=3,
            ordered=True,
            **{**ORDER, "event_type": "not.mine", "aggregate_id": "7"},
        )
    due = store.next_due(conn, ["order.created"])
    assert due is not None and 15 < due <= 20
    due_any = store.next_due(conn, None)
    assert due_any is not None and 0 < due_any <= 3


def test_a_held_off_listener_retries_at_a_bounded_rate_under_a_notification_storm(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str, connect: Connect
) -> None:
    # DESIGN "One claim run", step 1 (no thundering herd on the claim lock);
    # while another worker's run holds the claim lock, every notification
    # made the listener try again at once: hundreds of attempts a second per worker under a
    # storm of commits. Now the wait doubles up to 0.2 s while runs are held off, whatever
    # arrives, and the storm's notifications are drained meanwhile.
    import threading
    import time

    from psycopg_pool import ConnectionPool

    from outbox_celery import OutboxConfig
    from outbox_celery.claim.listener import Listener
    from outbox_celery.handlers import HandlerSpec
    from outbox_celery.testing import InProcess

    store = Store(table)
    channel = store.notify_channel(conn)
    holder = connect()
    stop = threading.Event()

    def storm() -> None:
        with psycopg.connect(migrated_dsn, autocommit=True) as c:
            while not stop.is_set():
                c.execute("SELECT pg_notify(%s, '')", [channel])

    with ConnectionPool(migrated_dsn, min_size=1, max_size=4, kwargs={"autocommit": True}, open=True) as pool:
        dispatcher = InProcess(
            OutboxConfig(table=table), pool.connection, {"e": HandlerSpec("e", lambda m: None, "q")}
        )
        listener = Listener(
            dsn=migrated_dsn,
            store=store,
            claim=lambda: dispatcher.claim_and_publish(lambda claims: len(claims)),
            event_types=lambda: ["e"],
            name="storm-test",
        )
        with holder.transaction():
            assert store.try_claim_lock(holder)  # another worker's claim run, held for the test
            listener.start()
            noise = threading.Thread(target=storm)
            noise.start()
            try:
                assert listener.connected.wait(10)
                time.sleep(0.3)
                before = listener.get_stats()
                time.sleep(1.0)
                after = listener.get_stats()
            finally:
                stop.set()
                noise.join(10)
                listener.stop()
    assert after["notifications"] - before["notifications"] > 100  # the storm was real
    assert after["claims"] - before["claims"] <= 10, (before, after)
