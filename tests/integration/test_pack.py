"""Packs (DESIGN invariant 30): one delivery task, one fenced start, a one-message handler per row.

In process against a real PostgreSQL; real workers (a pool process SIGKILLed mid-pack) are in
``tests/acceptance/test_celery_pack.py``. Here: what a claim's rows travel in, that a pack is
one start and then each message delivered and finished as a one-row task does, and that a pack
past its share of the lease hands back the rows it did not run, attempt refunded.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import ConnectionPool

from outbox_celery import Message, OutboxConfig, TableName
from outbox_celery.claim.units import publish_units
from outbox_celery.errors import ConfigurationError, PermanentError, RetryableError
from outbox_celery.handlers import HandlerSpec, register_handler
from outbox_celery.testing import InProcess
from outbox_celery.worker import deliverer

from .helpers import add, claim_units, fetch

EVENT = "thing.happened"


@pytest.fixture
def pool(migrated_dsn: str) -> Iterator[ConnectionPool[Any]]:
    with ConnectionPool(migrated_dsn, min_size=1, max_size=4, kwargs={"autocommit": True}, open=True) as p:
        yield p


def _dispatcher(pool: ConnectionPool[Any], table: str, fn: Any, pack: int = 4, **config: Any) -> InProcess:
    spec = HandlerSpec(EVENT, fn, "q", pack=pack)
    settings = {"backoff_base": 0.1, "backoff_cap": 0.5, "done_batch_delay": 0, **config}
    return InProcess(OutboxConfig(table=table, **settings), pool.connection, {EVENT: spec})


def _set(conn: psycopg.Connection[Any], table: str, outbox_id: int, assignment: str) -> None:
    conn.execute(
        sql.SQL("UPDATE {} SET " + assignment + " WHERE id = %s").format(TableName.parse(table).identifier()),
        [outbox_id],
    )


def test_invariant_30_a_claim_packs_fresh_rows_evenly_and_a_row_that_spent_an_attempt_travels_alone(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    ids = add(conn, 10, table=table)
    _set(conn, table, ids[4], "attempts = 1")  # retried once: it travels alone
    units = claim_units(_dispatcher(pool, table, lambda m: None, pack=4))
    assert sorted(len(u) for u in units) == [1, 3, 3, 3]
    [alone] = [u for u in units if len(u) == 1]
    assert alone[0].id == ids[4] and alone[0].attempts == 1
    assert sorted(c.id for u in units for c in u) == ids
    flat = [c for u in units for c in u]
    assert publish_units(flat, {EVENT: HandlerSpec(EVENT, print, "q", pack=4)}, max_attempts=10) == units


def test_invariant_30_no_pack_where_a_row_has_one_attempt_or_its_handler_none(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    add(conn, 6, table=table)
    one_attempt = _dispatcher(pool, table, lambda m: None, pack=4, max_attempts=1)
    assert {len(u) for u in claim_units(one_attempt)} == {1}
    add(conn, 6, table=table)
    assert {len(u) for u in claim_units(_dispatcher(pool, table, lambda m: None, pack=1))} == {1}


def test_invariant_30_a_pack_is_one_start_then_each_message_finished_as_a_task_of_its_own(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    modes = ["ok", "retry", "error", "permanent", "ok"]
    ids = add(conn, 5, table=table, payload=lambda i: {"mode": modes[i]})
    seen: list[tuple[int, int]] = []

    def handler(message: Message) -> None:
        seen.append((message.id, message.attempts))
        mode = message.payload["mode"]
        if mode == "retry":
            raise RetryableError("later")
        if mode == "error":
            raise ValueError("unexpected")
        if mode == "permanent":
            raise PermanentError("never")

    dispatcher = _dispatcher(pool, table, handler, pack=5)
    [unit] = claim_units(dispatcher)
    starts: list[int] = []
    start = dispatcher.store.completer.start

    def counted(*args: Any, **kwargs: Any) -> Any:
        starts.append(len(args[1]))
        return start(*args, **kwargs)

    dispatcher.store.completer.start = counted  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="unexpected"):  # after every other message ran
        dispatcher.deliver_batch([c.lease for c in unit])
    assert starts == [5]  # one fenced start for the pack
    assert seen == [(i, 1) for i in ids]  # each handler once, in claim order
    rows = [fetch(conn, table, i) for i in ids]
    assert [r["status"] for r in rows] == ["done", "pending", "pending", "dead", "done"]
    assert "unexpected" in rows[2]["last_error"]  # a failed attempt (invariant 31)
    assert [r["attempts"] for r in rows] == [1, 1, 1, 1, 1]
    # A redelivered pack task (an ack lost) calls nothing: every claim of it has started.
    seen.clear()
    assert dispatcher.deliver_batch([c.lease for c in unit]) == {"stale": 5}
    assert seen == []


def test_invariant_30_past_its_share_of_the_lease_a_pack_hands_back_what_it_did_not_run(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = add(conn, 4, table=table)
    _set(conn, table, ids[2], "last_error = 'an earlier failure'")
    seen: list[int] = []
    dispatcher = _dispatcher(pool, table, lambda m: seen.append(m.id), pack=4)
    [unit] = claim_units(dispatcher)
    monkeypatch.setattr(deliverer, "PACK_SHARE", 0.0)  # the share is spent once the first handler ran
    counts = dispatcher.deliver_batch([c.lease for c in unit])
    assert counts == {"done": 1, "handed_back": 3}
    assert seen == [ids[0]]
    rows = [fetch(conn, table, i) for i in ids]
    assert [r["status"] for r in rows] == ["done", "pending", "pending", "pending"]
    assert [r["attempts"] for r in rows] == [1, 0, 0, 0]  # refunded: their handler never ran
    assert rows[2]["last_error"] == "an earlier failure"  # kept
    due = conn.execute("SELECT now()").fetchone()
    assert due is not None and all(r["available_at"] <= due[0] for r in rows[1:])  # claimable at once
    # They travel in a pack again (no attempt spent) and are delivered.
    monkeypatch.setattr(deliverer, "PACK_SHARE", 0.1)
    [again] = claim_units(dispatcher)
    assert sorted(c.id for c in again) == ids[1:]
    assert dispatcher.deliver_batch([c.lease for c in again]) == {"done": 3}


def test_invariant_30_a_stale_pair_of_a_pack_is_dropped(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    ids = add(conn, 3, table=table)
    seen: list[int] = []
    dispatcher = _dispatcher(pool, table, lambda m: seen.append(m.id), pack=3)
    [unit] = claim_units(dispatcher)
    _set(conn, table, ids[1], "lease_version = lease_version + 1")  # claimed again since
    assert dispatcher.deliver_batch([c.lease for c in unit]) == {"done": 2, "stale": 1}
    assert seen == [ids[0], ids[2]]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pack": 0}, "pack must be an int from 1 to 100"),
        ({"pack": 101}, "pack must be an int from 1 to 100"),
        ({"pack": True}, "pack must be an int"),
        ({"pack": 4, "batch": 10}, "both batch= and pack="),
        ({"pack": 4, "concurrency": 2}, "pack= cannot be combined with concurrency="),
        ({"pack": 4, "key_concurrency": 2}, "pack= cannot be combined with concurrency="),
    ],
)
def test_pack_is_checked_where_it_is_declared(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        register_handler({}, EVENT, **options)(lambda m: None)


def test_invariant_30_a_payload_this_worker_cannot_decode_costs_only_its_own_row(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    """A row written by SQL with a type no process registered, another nested deeper than the
    decoder goes: each fails before its handler on its own; the rest of the pack runs."""
    ids = add(conn, 4, table=table, payload=lambda i: {"i": i})
    t = TableName.parse(table).identifier()
    update = sql.SQL("UPDATE {} SET payload = %s::json WHERE id = %s").format(t)
    conn.execute(update, ['{"__type__": "nope", "__value__": 1}', ids[1]])
    conn.execute(update, ["[" * 900 + "]" * 900, ids[2]])
    seen: list[int] = []
    dispatcher = _dispatcher(pool, table, lambda m: seen.append(m.id), pack=4)
    [unit] = claim_units(dispatcher)
    assert [c.id for c in unit] == ids
    counts = dispatcher.deliver_batch([c.lease for c in unit])
    assert counts == {"done": 2, "error": 2}
    assert seen == [ids[0], ids[3]]
    rows = [fetch(conn, table, i) for i in ids]
    assert [r["status"] for r in rows] == ["done", "pending", "pending", "done"]
    assert [r["attempts"] for r in rows] == [1, 1, 1, 1]
    assert "failed before calling the handler" in rows[1]["last_error"] and "nope" in rows[1]["last_error"]
    assert "RecursionError" in rows[2]["last_error"]
