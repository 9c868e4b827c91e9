"""A freed slot wakes the claim: a concurrency-limited delivery's finish is written at once
and notifies the table's channel (``SLOT_FREED``), so a push listener held back by the limit
hands the slot out then, not ``LIMIT_RECHECK`` (or a held done's ``done_batch_delay``) later
(docs/flow-control.md; the listener's side: tests/unit/test_listener.py).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import ConnectionPool
from support import steps

from outbox_celery import OutboxConfig, Store, TableName
from outbox_celery.claim.executor import Claimed
from outbox_celery.claim.listener import Listener
from outbox_celery.db.store import SLOT_FREED
from outbox_celery.errors import Defer, PermanentError, RetryableError
from outbox_celery.flow import Limit
from outbox_celery.handlers import HandlerSpec
from outbox_celery.message import Message, Outcome
from outbox_celery.testing import InProcess

from .helpers import LONG, add, fetch

T = "webhook.limited"


@pytest.fixture
def pool(migrated_dsn: str) -> Any:
    with ConnectionPool(migrated_dsn, min_size=1, max_size=6, kwargs={"autocommit": True}, open=True) as p:
        yield p


def _dispatcher(
    pool: ConnectionPool[Any],
    table: str,
    handler: Callable[[Message], None],
    limit: Limit | None,
    **config: Any,
) -> InProcess:
    spec = HandlerSpec(T, handler, "q", limit=limit)
    return InProcess(OutboxConfig(table=table, **config), pool.connection, {T: spec})


def _raise(exc: BaseException) -> Callable[[Message], None]:
    def handler(message: Message) -> None:
        raise exc

    return handler


@pytest.mark.parametrize(
    ("handler", "ordered", "outcome", "status"),
    [
        (lambda m: None, False, Outcome.DONE, "done"),
        (lambda m: None, True, Outcome.DONE, "done"),
        (_raise(RetryableError("503")), False, Outcome.RETRY, "pending"),
        (_raise(Defer(5.0, "later")), False, Outcome.DEFER, "pending"),
        (_raise(PermanentError("400")), False, Outcome.DEAD, "dead"),
    ],
    ids=["done", "ordered-done", "retry", "defer", "dead"],
)
def test_a_finished_concurrency_limited_delivery_is_written_at_once_and_wakes_the_listeners(
    conn: psycopg.Connection[Any],
    table: str,
    pool: ConnectionPool[Any],
    migrated_dsn: str,
    handler: Callable[[Message], None],
    ordered: bool,
    outcome: Outcome,
    status: str,
) -> None:
    # A done window far longer than the test: a held done would still be processing.
    dispatcher = _dispatcher(
        pool, table, handler, Limit(concurrency=1), lease=LONG, done_batch_delay=LONG / 5
    )
    [i] = add(conn, table=table, event_type=T, key="k" if ordered else None)
    # The claim takes the one row its limit allows: it leaves the type at its limit (at_cap).
    claimed = steps.claim(
        dispatcher.store,
        conn,
        limit=1,
        lease=LONG,
        owner="w",
        max_attempts=5,
        limits={T: Limit(concurrency=1)},
    )
    [c] = claimed.claimed
    with psycopg.connect(migrated_dsn, autocommit=True) as listener:
        channel = Store(table).listen(listener)
        assert dispatcher.deliver(i, c.lease_version, batch_done=True) == outcome
        assert fetch(conn, table, i)["status"] == status  # written, not held
        got = list(listener.notifies(timeout=5.0, stop_after=1))
        assert [(n.channel, n.payload) for n in got] == [(channel, SLOT_FREED)]
    assert dispatcher.done_batch is not None and dispatcher.done_batch.pending() == 0


@pytest.mark.parametrize("limit", [None, Limit(rate=1000.0)], ids=["unlimited", "rate-only"])
def test_other_types_dones_are_still_batched_and_wake_nobody(
    conn: psycopg.Connection[Any],
    table: str,
    pool: ConnectionPool[Any],
    migrated_dsn: str,
    limit: Limit | None,
) -> None:
    dispatcher = _dispatcher(pool, table, lambda m: None, limit, lease=LONG, done_batch_delay=LONG / 5)
    [i] = add(conn, table=table, event_type=T)
    [c] = steps.claim(dispatcher.store, conn, limit=1, lease=LONG, owner="w", max_attempts=5).claimed
    with psycopg.connect(migrated_dsn, autocommit=True) as listener:
        Store(table).listen(listener)
        assert dispatcher.deliver(i, c.lease_version, batch_done=True) == Outcome.DONE
        assert fetch(conn, table, i)["status"] == "processing"  # held by the batcher
        assert list(listener.notifies(timeout=0.3)) == []
    dispatcher.flush()
    assert fetch(conn, table, i)["status"] == "done"


def _at_cap(conn: psycopg.Connection[Any], table: str) -> bool:
    flow = TableName.parse(table).identifier("_flow")
    query = sql.SQL("SELECT at_cap FROM {} WHERE event_type = %s").format(flow)
    row = conn.execute(query, [T]).fetchone()
    return bool(row and row[0])


def test_below_its_limit_a_limited_types_done_stays_batched_and_wakes_nobody(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any], migrated_dsn: str
) -> None:
    """The cost side: a limit that does not bind keeps the batched done (nobody waits for a slot)."""
    limit = Limit(concurrency=5)
    dispatcher = _dispatcher(pool, table, lambda m: None, limit, lease=LONG, done_batch_delay=LONG / 5)
    ids = add(conn, 2, table=table, event_type=T)
    got = steps.claim(
        dispatcher.store, conn, limit=10, lease=LONG, owner="w", max_attempts=5, limits={T: limit}
    )
    assert len(got.claimed) == 2 and not _at_cap(conn, table)  # 2 of the 5 allowed
    with psycopg.connect(migrated_dsn, autocommit=True) as listener:
        Store(table).listen(listener)
        for c in got.claimed:
            assert dispatcher.deliver(c.id, c.lease_version, batch_done=True) == Outcome.DONE
        assert {fetch(conn, table, i)["status"] for i in ids} == {"processing"}  # held by the batcher
        assert list(listener.notifies(timeout=0.3)) == []
    dispatcher.flush()
    assert {fetch(conn, table, i)["status"] for i in ids} == {"done"}


def test_the_claim_records_whether_it_left_a_type_at_its_limit(
    conn: psycopg.Connection[Any], table: str, store: Store
) -> None:
    limits = {T: Limit(concurrency=2)}
    add(conn, 3, table=table, event_type=T)
    first = steps.claim(store, conn, limit=10, lease=LONG, owner="w", max_attempts=5, limits=limits).claimed
    assert len(first) == 2 and _at_cap(conn, table)
    assert store.capped(conn, [T, "other"]) == {T}
    for c in first:
        assert steps.done(store, conn, c.id, c.lease_version)
    # The last row: 1 of the 2 allowed, so the type is no longer at its limit.
    assert (
        len(steps.claim(store, conn, limit=10, lease=LONG, owner="w", max_attempts=5, limits=limits).claimed)
        == 1
    )
    assert not _at_cap(conn, table) and store.capped(conn, [T]) == frozenset()


def test_a_freed_slot_is_handed_out_by_the_listener_at_once(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any], migrated_dsn: str
) -> None:
    """concurrency=1, a listener claiming, one delivery thread: the next message starts well
    before a held done (1 s window) could have been written; before this change it waited for it."""
    spans: list[tuple[float, float]] = []

    def handler(message: Message) -> None:
        started = time.monotonic()
        time.sleep(0.1)
        spans.append((started, time.monotonic()))

    dispatcher = _dispatcher(pool, table, handler, Limit(concurrency=1), lease=LONG, done_batch_delay=1.0)
    n = 4
    add(conn, n, table=table, event_type=T)
    tasks: queue.Queue[Claimed | None] = queue.Queue()

    def publish(claims: Any) -> int:
        for c in claims:
            tasks.put(c)
        return len(claims)

    listener = Listener(
        dsn=migrated_dsn,
        store=dispatcher.store,
        claim=lambda: dispatcher.claim_and_publish(publish, owner="t"),
        event_types=lambda: [T],
        poll=5.0,  # beyond the test: only notifications and LIMIT_RECHECK wake it
    )

    def worker() -> None:
        while (c := tasks.get()) is not None:
            dispatcher.deliver(c.id, c.lease_version, batch_done=True)

    thread = threading.Thread(target=worker)
    thread.start()
    listener.start()
    try:
        deadline = time.monotonic() + 20
        while len(spans) < n:
            assert time.monotonic() < deadline, f"only {len(spans)} of {n} delivered"
            time.sleep(0.01)
    finally:
        listener.stop()
        tasks.put(None)
        thread.join(10)
    spans.sort()
    assert all(b[0] >= a[1] for a, b in itertools.pairwise(spans))  # never two at once
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(spans)]
    # Generous for a shared machine; a held done alone would make each gap about 1 s.
    assert max(gaps) < 0.5, gaps


@pytest.mark.parametrize("kind", ["batch", "key_concurrency"])
def test_invariant_25_a_batch_or_a_key_at_its_limit_wakes_the_listeners_when_it_finishes(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any], migrated_dsn: str, kind: str
) -> None:
    # The listener looks again only after CAP_RECHECK (1 s) at a limit: a batch handler's finish
    # and a finish of a key at its key_concurrency must wake it, as a one-row delivery's does.
    if kind == "batch":
        limit = Limit(concurrency=2)
        spec = HandlerSpec(T, lambda ms: None, "q", batch=2, limit=limit)
        ids = add(conn, 2, table=table, event_type=T)
    else:
        limit = Limit(key_concurrency=1)
        spec = HandlerSpec(T, lambda m: None, "q", limit=limit)
        ids = add(conn, 2, table=table, event_type=T, limit_key="t1")[:1]
    dispatcher = InProcess(OutboxConfig(table=table, lease=LONG), pool.connection, {T: spec})
    claimed = steps.claim(
        dispatcher.store, conn, limit=10, lease=LONG, owner="w", max_attempts=5, limits={T: limit}
    )
    assert sorted(c.id for c in claimed.claimed) == ids
    with psycopg.connect(migrated_dsn, autocommit=True) as listener:
        channel = Store(table).listen(listener)
        if kind == "batch":
            dispatcher.deliver_batch([(c.id, c.lease_version) for c in claimed.claimed])
        else:
            [c] = claimed.claimed
            assert dispatcher.deliver(c.id, c.lease_version) == Outcome.DONE
        got = list(listener.notifies(timeout=5.0, stop_after=1))
        # A batch's finish notifies with every batch (an empty payload: the listener claims);
        # a one-row finish of a type at its limit with SLOT_FREED.
        assert [(n.channel, n.payload) for n in got] == [(channel, "" if kind == "batch" else SLOT_FREED)]
