"""enqueue / enqueue_many in the caller's transaction; producer-side ordering (invariant 9)."""

from __future__ import annotations

import math
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import pq, sql

from outbox_celery import Event, ProducerError, Store, TableName, enqueue, enqueue_many
from outbox_celery.produce.writes import ProducerWrites

from .helpers import Connect, count, fetch, fetch_all

ORDER = {"event_type": "order.created", "aggregate_type": "order", "aggregate_id": "42"}


def test_enqueue_commits_with_the_business_transaction(
    conn: psycopg.Connection[Any], table: str, connect: Connect
) -> None:
    payload = {"total": 12.5, "lines": [{"sku": "ü-1", "qty": 2}], "gift": False, "note": None, "e": "😀"}
    other = connect()
    with conn.transaction():
        i = enqueue(conn, payload=payload, table=table, **ORDER)
        assert count(other, table) == 0, "visible before commit"
    row = fetch(other, table, i)
    assert row["payload"] == payload
    assert (row["event_type"], row["aggregate_type"], row["aggregate_id"]) == ("order.created", "order", "42")
    assert (row["status"], row["attempts"], row["lease_version"]) == ("pending", 0, 0)
    assert row["ordering_key"] is None
    assert row["available_in"] <= 0
    assert row["lease_until"] is None and row["done_at"] is None and row["last_error"] is None


def test_enqueue_rolls_back_with_the_business_transaction(conn: psycopg.Connection[Any], table: str) -> None:
    with conn.transaction(force_rollback=True):
        enqueue(conn, payload={}, table=table, **ORDER)
        assert count(conn, table) == 1
    assert count(conn, table) == 0


def test_enqueue_on_a_non_autocommit_connection_waits_for_its_commit(
    migrated_dsn: str, table: str, connect: Connect
) -> None:
    other = connect()
    with psycopg.connect(migrated_dsn) as c:
        enqueue(c, payload={"a": 1}, table=table, **ORDER)
        assert c.info.transaction_status == pq.TransactionStatus.INTRANS
        assert count(other, table) == 0
        c.commit()
    assert count(other, table) == 1


@pytest.mark.parametrize("table", ["outbox", "events.Out Box"])
def test_enqueue_many_returns_ids_in_input_order(conn: psycopg.Connection[Any], table: str) -> None:
    messages: list[Event | dict[str, Any]] = []
    for n in range(50):
        if n % 2:
            messages.append(Event("e.odd", {"n": n}, "agg", n, ordered=n % 3 == 0))
        else:
            messages.append(
                {"event_type": "e.even", "payload": {"n": n}, "aggregate_type": "agg", "aggregate_id": n}
            )
    with conn.transaction():
        ids = enqueue_many(conn, messages, table=table)
    assert len(ids) == 50 and len(set(ids)) == 50
    for n, i in enumerate(ids):
        row = fetch(conn, table, i)
        assert row["payload"] == {"n": n}
        assert row["aggregate_id"] == str(n)
        assert row["event_type"] == ("e.odd" if n % 2 else "e.even")
        assert row["ordering_key"] == (f"agg:{n}" if n % 2 and n % 3 == 0 else None)


def test_enqueue_many_of_nothing_writes_nothing(conn: psycopg.Connection[Any], table: str) -> None:
    with conn.transaction():
        assert enqueue_many(conn, [], table=table) == []
    assert count(conn, table) == 0


def test_enqueue_many_inserts_thousands_in_one_go(conn: psycopg.Connection[Any], table: str) -> None:
    n = 5000
    events = [Event("bulk.item", {"n": k, "pad": "x" * 50}, "bulk", k) for k in range(n)]
    with conn.transaction():
        ids = enqueue_many(conn, events, table=table)
    assert len(ids) == n
    assert ids == sorted(ids) and len(set(ids)) == n
    query = sql.SQL("SELECT id, (payload->>'n')::int FROM {} ORDER BY id").format(
        TableName.parse(table).identifier()
    )
    assert conn.execute(query).fetchall() == [(i, k) for k, i in enumerate(ids)]


def test_enqueue_many_ids_stay_in_input_order_while_other_producers_insert(
    conn: psycopg.Connection[Any], table: str, connect: Connect
) -> None:
    # enqueue_many maps ids back to inputs by sorting them; concurrent producers draw from the
    # same identity sequence, so their ids interleave with ours.
    barrier = threading.Barrier(3)
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def produce(n: int) -> None:
        try:
            c = connect()
            barrier.wait(10)
            for _ in range(5):
                events = [Event("e", {"producer": n, "k": k}, "a", k) for k in range(400)]
                with c.transaction():
                    results.setdefault(n, []).extend(enqueue_many(c, events, table=table))
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    query = sql.SQL("SELECT id, (payload->>'producer')::int, (payload->>'k')::int FROM {}").format(
        TableName.parse(table).identifier()
    )
    stored = {i: (p, k) for i, p, k in conn.execute(query).fetchall()}
    assert len(stored) == 3 * 5 * 400
    for n, ids in results.items():
        assert [stored[i] for i in ids] == [(n, k) for _ in range(5) for k in range(400)]


@pytest.mark.parametrize(
    ("delay", "seconds"),
    [(30, 30.0), (0.5, 0.5), (timedelta(minutes=2), 120.0), (timedelta(days=3), 259200.0)],
)
def test_delay_sets_available_at_in_the_future_by_the_database_clock(
    conn: psycopg.Connection[Any], table: str, delay: float | timedelta, seconds: float
) -> None:
    with conn.transaction():
        i = enqueue(conn, payload={}, table=table, delay=delay, **ORDER)
        [j] = enqueue_many(conn, [Event("x", {}, "a", 1, delay=delay)], table=table)
        # Same transaction: now() is the insert's clock, so the offset is exact.
        for k in (i, j):
            assert fetch(conn, table, k)["available_in"] == pytest.approx(seconds, abs=1e-3)
    if seconds >= 30:  # still ahead of the database clock after the commit
        for k in (i, j):
            assert 0 < fetch(conn, table, k)["available_in"] <= seconds


def test_ordered_events_get_their_aggregate_as_key(conn: psycopg.Connection[Any], table: str) -> None:
    with conn.transaction():
        a = enqueue(conn, payload={}, table=table, ordered=True, **ORDER)
        b = enqueue(conn, payload={}, table=table, ordering_key="customer:7", **ORDER)
    assert fetch(conn, table, a)["ordering_key"] == "order:42"
    assert fetch(conn, table, b)["ordering_key"] == "customer:7"


BAD: list[tuple[dict[str, Any], str]] = [
    ({"payload": {1, 2}}, "not JSON-serializable"),
    ({"payload": {"x": math.nan}}, "not JSON-serializable"),
    ({"payload": [math.inf]}, "not JSON-serializable"),
    ({"payload": "x" * 100}, "the limit is 64"),
    ({"payload": "a\x00b"}, "NUL"),
    ({"payload": "\udc00"}, "not JSON-serializable"),
    ({"event_type": ""}, "event_type must not be empty"),
    ({"event_type": "e" * 201}, "event_type is 201 characters"),
    ({"aggregate_type": " "}, "aggregate_type must not be empty"),
    ({"aggregate_type": "a" * 201}, "aggregate_type is 201 characters"),
    ({"aggregate_id": ""}, "aggregate_id must not be empty"),
    ({"aggregate_id": "9" * 201}, "aggregate_id is 201 characters"),
    ({"delay": -1}, "delay must be a number of seconds between 0"),
]


@pytest.mark.parametrize(("bad", "match"), BAD)
def test_bad_input_writes_nothing_and_leaves_the_transaction_usable(
    conn: psycopg.Connection[Any], table: str, bad: dict[str, Any], match: str
) -> None:
    fields = {**ORDER, "payload": {"ok": True}, **bad}
    with conn.transaction():
        with pytest.raises(ProducerError, match=match):
            enqueue(conn, table=table, max_payload_bytes=64, **fields)
        # Refused before any SQL ran: the business transaction goes on.
        assert conn.info.transaction_status == pq.TransactionStatus.INTRANS
        enqueue(conn, table=table, payload={"ok": True}, **ORDER)
    assert [r["payload"] for r in fetch_all(conn, table)] == [{"ok": True}]


@pytest.mark.parametrize(("bad", "match"), BAD)
def test_one_bad_message_refuses_the_whole_batch(
    conn: psycopg.Connection[Any], table: str, bad: dict[str, Any], match: str
) -> None:
    good = [Event("e", {"n": n}, "a", n) for n in range(5)]
    broken = {**ORDER, "payload": {"ok": True}, **bad}
    with conn.transaction(), pytest.raises(ProducerError, match="message 3: .*" + match):
        enqueue_many(conn, [*good[:3], broken, *good[3:]], table=table, max_payload_bytes=64)
    assert count(conn, table) == 0


def test_payload_size_limit_is_inclusive(conn: psycopg.Connection[Any], table: str) -> None:
    with conn.transaction():
        enqueue(conn, payload="x" * 62, table=table, max_payload_bytes=64, **ORDER)
        with pytest.raises(ProducerError, match="65 bytes as JSON; the limit is 64"):
            enqueue(conn, payload="x" * 63, table=table, max_payload_bytes=64, **ORDER)
    assert count(conn, table) == 1


def test_a_payload_with_an_escaped_backslash_u_sequence_roundtrips(
    conn: psycopg.Connection[Any], table: str
) -> None:
    payload = {"path": "C:\\u0000dir", "regex": "\\\\u0000"}
    with conn.transaction():
        i = enqueue(conn, payload=payload, table=table, **ORDER)
    assert fetch(conn, table, i)["payload"] == payload


def test_autocommit_outside_a_transaction_is_refused(conn: psycopg.Connection[Any], table: str) -> None:
    assert conn.autocommit
    with pytest.raises(ProducerError, match="autocommit"):
        enqueue(conn, payload={}, table=table, **ORDER)
    with pytest.raises(ProducerError, match="autocommit"):
        enqueue_many(conn, [Event("e", {}, "a", 1)], table=table)
    assert count(conn, table) == 0


def test_allow_autocommit_permits_a_write_that_commits_on_its_own(
    conn: psycopg.Connection[Any], table: str, connect: Connect
) -> None:
    i = enqueue(conn, payload={"a": 1}, table=table, allow_autocommit=True, **ORDER)
    ids = enqueue_many(conn, [Event("e", {}, "a", 1, ordered=True)], table=table, allow_autocommit=True)
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    other = connect()
    assert fetch(other, table, i)["payload"] == {"a": 1}
    assert fetch(other, table, ids[0])["ordering_key"] == "a:1"


def test_a_failed_transaction_is_refused(conn: psycopg.Connection[Any], table: str) -> None:
    with conn.transaction(force_rollback=True):
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
        assert conn.info.transaction_status == pq.TransactionStatus.INERROR
        with pytest.raises(ProducerError, match="roll it back"):
            enqueue(conn, payload={}, table=table, **ORDER)
        with pytest.raises(psycopg.errors.InFailedSqlTransaction):
            conn.execute("SELECT 1")


def test_the_check_constraint_backs_the_validation(conn: psycopg.Connection[Any], table: str) -> None:
    # Writers that bypass enqueue still cannot store an empty event type.
    with pytest.raises(psycopg.errors.CheckViolation):
        ProducerWrites(Store(table)).insert(
            conn,
            {
                "event_type": "",
                "aggregate_type": "a",
                "aggregate_id": "1",
                "payload": "{}",
                "ordering_key": None,
                "delay": 0.0,
            },
        )


# -- producers of one ordering key are serialized until commit (DESIGN invariant 9) ---------


def _producer_in_thread(
    connect: Connect,
    table: str,
    key: str,
    done: threading.Event,
    result: dict[str, Any],
    *,
    many: bool = False,
) -> threading.Thread:
    c = connect()

    def run() -> None:
        with c.transaction():
            if many:
                events = [
                    Event("e", {}, "a", 1, ordering_key="other"),
                    Event("e", {}, "a", 2, ordering_key=key),
                ]
                result["id"] = enqueue_many(c, events, table=table)[-1]
            else:
                result["id"] = enqueue(c, payload={}, table=table, ordering_key=key, **ORDER)
            result["returned_at"] = time.monotonic()
            done.set()
        result["committed_at"] = time.monotonic()

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("many", [False, True], ids=["enqueue", "enqueue_many"])
def test_invariant_9_producers_of_one_key_are_serialized_until_commit(
    conn: psycopg.Connection[Any], table: str, connect: Connect, many: bool
) -> None:
    first_done = threading.Event()
    second_done = threading.Event()
    other_key_done = threading.Event()
    second: dict[str, Any] = {}
    other_key: dict[str, Any] = {}
    with conn.transaction():
        first = enqueue(conn, payload={}, table=table, ordered=True, **ORDER)
        first_done.set()
        t2 = _producer_in_thread(connect, table, "order:42", second_done, second, many=many)
        t3 = _producer_in_thread(connect, table, "order:43", other_key_done, other_key, many=many)
        # A different key does not wait for us...
        assert other_key_done.wait(10), "a producer of another key was blocked"
        # ...the same key does, for as long as we have not committed.
        assert not second_done.wait(0.5), "a second producer of the same key did not wait"
        committed_at = time.monotonic()
    assert second_done.wait(10)
    t2.join(10)
    t3.join(10)
    assert second["returned_at"] >= committed_at
    # Id order equals commit order for the key.
    assert first < second["id"]
    assert fetch(conn, table, second["id"])["ordering_key"] == "order:42"


def test_invariant_9_unordered_producers_never_wait(
    conn: psycopg.Connection[Any], table: str, connect: Connect
) -> None:
    done = threading.Event()
    result: dict[str, Any] = {}
    other = connect()

    def run() -> None:
        with other.transaction():
            result["id"] = enqueue(other, payload={}, table=table, **ORDER)
        done.set()

    with conn.transaction():
        enqueue(conn, payload={}, table=table, **ORDER)
        enqueue(conn, payload={}, table=table, ordered=True, **ORDER)
        t = threading.Thread(target=run)
        t.start()
        assert done.wait(10)
    t.join(10)


def test_invariant_9_an_autocommit_ordered_enqueue_still_holds_its_key_until_commit(
    conn: psycopg.Connection[Any], table: str, connect: Connect
) -> None:
    # A test-only trigger makes the autocommit producer's insert slow: if the key lock were
    # released before the insert committed, the second producer would draw a higher id and
    # commit first, and id order would no longer be commit order.
    ident = TableName.parse(table)
    slow = sql.Identifier(ident.schema or "public", "slow_insert")
    conn.execute(
        sql.SQL(
            "CREATE FUNCTION {}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            " IF NEW.payload::jsonb ? 'slow' THEN PERFORM pg_sleep(0.5); END IF; RETURN NEW; END $$"
        ).format(slow)
    )
    conn.execute(
        sql.SQL("CREATE TRIGGER slow BEFORE INSERT ON {} FOR EACH ROW EXECUTE FUNCTION {}()").format(
            ident.identifier(), slow
        )
    )
    started = threading.Event()
    result: dict[str, Any] = {}
    auto = connect()

    def run() -> None:
        started.set()
        result["id"] = enqueue(
            auto, payload={"slow": True}, table=table, ordered=True, allow_autocommit=True, **ORDER
        )

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(5)
    # Wait until the autocommit producer sleeps inside its insert.
    deadline = time.monotonic() + 10
    while conn.execute(
        "SELECT wait_event IS DISTINCT FROM 'PgSleep' FROM pg_stat_activity WHERE pid = %s",
        [auto.info.backend_pid],
    ).fetchone() != (False,):
        assert time.monotonic() < deadline, "the autocommit producer never reached its insert"
        time.sleep(0.01)
    with conn.transaction():
        mine = enqueue(conn, payload={}, table=table, ordered=True, **ORDER)
        # When we got the key, every lower id of the key had committed.
        lower = count(conn, table, f"id < {int(mine)}")
        t.join(10)
        assert "id" in result
    assert result["id"] < mine
    assert lower == 1


def test_invariant_9_the_key_lock_does_not_depend_on_how_the_table_is_spelled(
    conn: psycopg.Connection[Any], connect: Connect
) -> None:
    done = threading.Event()
    result: dict[str, Any] = {}
    other = connect()

    def run() -> None:
        with other.transaction():
            result["id"] = enqueue(other, payload={}, table="public.outbox", ordered=True, **ORDER)
        done.set()

    with conn.transaction():
        first = enqueue(conn, payload={}, table="outbox", ordered=True, **ORDER)
        t = threading.Thread(target=run)
        t.start()
        assert not done.wait(0.5), "a producer spelling the table 'public.outbox' did not wait"
    assert done.wait(10)
    t.join(10)
    assert first < result["id"]


def test_outbox_enqueue_applies_the_configured_table_and_max_payload_bytes(
    conn: psycopg.Connection[Any], table: str, migrated_dsn: str
) -> None:
    from celery import Celery

    from outbox_celery import Outbox

    outbox = Outbox(Celery("payload-limit"), dsn=migrated_dsn, table=table, max_payload_bytes=64)
    with conn.transaction():
        with pytest.raises(ProducerError, match="the limit is 64"):
            outbox.enqueue(conn, payload={"big": "x" * 100}, **ORDER)
        with pytest.raises(ProducerError, match="the limit is 64"):
            outbox.enqueue_many(conn, [Event("e", {"big": "x" * 100}, "a", 1)])
        first = outbox.enqueue(conn, payload={"ok": True}, **ORDER)
        assert outbox.enqueue_many(conn, [Event("e", {"n": 1}, "a", 1)]) == [first + 1]
    assert [r["payload"] for r in fetch_all(conn, table)] == [{"ok": True}, {"n": 1}]


def test_invariant_9_a_batch_with_more_ordering_keys_than_the_lock_bound_is_refused_before_writing(
    conn: psycopg.Connection[Any], table: str
) -> None:
    # One key lock per distinct ordering key is held to commit; 20,000 keys
    # exhausted a stock server's shared lock table ("out of shared memory", for every session).
    # Above MAX_ORDERING_KEYS the batch is refused with a useful message and nothing is written
    # or locked; at the bound it goes through, every key with its head.
    bound = 1000  # outbox_celery.db.store.MAX_ORDERING_KEYS, documented in docs/integrations.md

    def events(n: int) -> list[Event]:
        return [Event("e", {"i": i}, "a", str(i), ordering_key=f"k{i}") for i in range(n)]

    with conn.transaction():
        with pytest.raises(ProducerError, match=r"1001 distinct ordering keys.*split the events") as refused:
            enqueue_many(conn, events(bound + 1), table=table)
        assert "out of shared memory" in str(refused.value)
        locks = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory'"
        ).fetchone()
        assert locks == (0,)
    assert count(conn, table) == 0
    with conn.transaction():
        ids = enqueue_many(conn, events(bound), table=table)
    assert len(ids) == bound == count(conn, table, "head")
    # Many events of few keys are not limited.
    with conn.transaction():
        many = [Event("e", {"i": i}, "a", str(i), ordering_key=f"k{i % 3}") for i in range(3000)]
        assert len(enqueue_many(conn, many, table=table)) == 3000
