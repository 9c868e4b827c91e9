"""Batch handlers (DESIGN invariant 21): the batch statements and the dispatcher, in process.

Real workers are in ``tests/acceptance/test_celery_batch.py``. Here: the batch's fenced start
drops stale pairs, counts an attempt once per started row and resumes after a lost reply; its
finalize writes, row by row, exactly what the one-row finalizer of each outcome writes; the
dispatcher turns a handler's return value or exception into those outcomes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import ConnectionPool
from support import steps

from outbox_celery import Message, OutboxConfig, Store, TableName, ops
from outbox_celery.claim.executor import Claimed, ClaimResult, ScanMarks
from outbox_celery.claim.units import publish_units
from outbox_celery.db.completer import Finish, Lease, Step
from outbox_celery.errors import Defer, PermanentError, RateLimited, RetryableError
from outbox_celery.handlers import HandlerSpec
from outbox_celery.testing import InProcess

from .helpers import LONG, PAST_SHORT, SHORT, add, claim_ids, claim_units, fetch

EVENT = "metrics.sample"


def _claim(conn: psycopg.Connection[Any], store: Store, n: int) -> list[Claimed]:
    return steps.claim(store, conn, limit=n, lease=LONG, owner="w", max_attempts=5).claimed


def _set(conn: psycopg.Connection[Any], table: str, outbox_id: int, assignment: str) -> None:
    """A test's own literal assignment on one row (``attempts = 5``...)."""
    conn.execute(
        sql.SQL("UPDATE {} SET " + assignment + " WHERE id = %s").format(TableName.parse(table).identifier()),
        [outbox_id],
    )


def test_invariant_21_one_start_drops_stale_pairs_and_counts_each_started_row_once(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    ids = add(conn, 4, table=table)
    claims = {c.id: c.lease_version for c in _claim(conn, store, 4)}
    superseded, started_elsewhere = ids[0], ids[1]
    _set(conn, table, superseded, "lease_version = lease_version + 1")  # re-claimed since
    assert steps.start(store, conn, started_elsewhere, claims[started_elsewhere], lease=LONG, max_attempts=5)
    pairs = [(i, claims[i]) for i in ids]

    msgs = steps.start_many(store, conn, pairs, lease=LONG, max_attempts=5, starter="w:1:a")
    assert [m.id for m in msgs] == ids[2:]
    assert all(isinstance(m, Message) and m.attempts == 1 for m in msgs)
    assert [fetch(conn, table, i)["attempts"] for i in ids] == [0, 1, 1, 1]
    # The same start again (its reply was lost): the rows come back, nothing counted twice.
    again = steps.start_many(store, conn, pairs, lease=LONG, max_attempts=5, starter="w:1:a")
    assert [m.id for m in again] == ids[2:]
    # Another task of the same claims (a redelivery): refused.
    assert steps.start_many(store, conn, pairs, lease=LONG, max_attempts=5, starter="w:2:b") == []
    assert [fetch(conn, table, i)["attempts"] for i in ids] == [0, 1, 1, 1]


def test_invariant_21_a_batch_start_with_no_attempt_left_makes_the_row_dead(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    ids = add(conn, 2, table=table)
    claims = {c.id: c.lease_version for c in _claim(conn, store, 2)}
    _set(conn, table, ids[0], "attempts = 5")
    msgs = steps.start_many(store, conn, list(claims.items()), lease=LONG, max_attempts=5, starter="w:1:a")
    assert [m.id for m in msgs] == [ids[1]]
    row = fetch(conn, table, ids[0])
    assert row["status"] == "dead"
    assert "attempts exhausted" in row["last_error"]


class _Results(psycopg.Cursor[Any]):
    """A cursor that records the bytes of every result it receives (all its values)."""

    sizes: list[int] = []

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        out = super().execute(*args, **kwargs)
        res = self.pgresult
        if res is not None:
            _Results.sizes.append(
                sum(len(res.get_value(r, c) or b"") for r in range(res.ntuples) for c in range(res.nfields))
            )
        return out


def test_a_batch_start_reads_large_payloads_in_results_of_bounded_size(
    conn: psycopg.Connection[Any], migrated_dsn: str, store: Store, table: str
) -> None:
    # A batch whose payloads together are far over the completer's byte budget: the start's
    # result, and every chunk of payloads read after it, stays within the budget (one payload
    # may be alone over it), and every message gets its own payload back.
    budget = 256 * 1024
    store.completer.inline_bytes = budget
    big = {i: {"blob": os.urandom(45_000).hex(), "i": i} for i in range(12)}  # ~90 KB each
    ids = add(conn, 12, table=table, payload=big.__getitem__)
    claims = {c.id: c.lease_version for c in _claim(conn, store, 12)}
    with psycopg.connect(migrated_dsn, autocommit=True, cursor_factory=_Results) as worker:
        _Results.sizes = []
        msgs = steps.start_many(
            store, worker, list(claims.items()), lease=LONG, max_attempts=5, starter="w:1:a"
        )
        sizes = list(_Results.sizes)
    assert [m.id for m in msgs] == ids
    assert [m.payload for m in msgs] == [big[i] for i in range(12)]
    assert sum(sizes) > 4 * budget  # the payloads did come through, in several results
    assert max(sizes) <= budget + 12 * 200, sizes  # 200: a row's other columns, generously
    # One message alone takes the whole budget: its payload comes with the start.
    [one] = add(conn, 1, table=table, payload=lambda _: big[0])
    [c] = _claim(conn, store, 1)
    assert c.id == one
    with psycopg.connect(migrated_dsn, autocommit=True, cursor_factory=_Results) as worker:
        _Results.sizes = []
        started = steps.start(store, worker, c.id, c.lease_version, lease=LONG, max_attempts=5)
        assert started is not None and started.payload == big[0]
        assert len(_Results.sizes) == 1


# (outcome, delay, error) per row, written by the completer's one statement in its one-row form
# (one row per call) and in its form of many rows (finish_many): the two forms differ only
# in where the rows come from (_sql.one_row), and must write the same.
CASES: list[tuple[str, float, str]] = [
    ("done", 0.0, ""),
    ("retry", 30.0, "HTTP 503"),
    ("retry", 30.0, "HTTP 503 at the limit"),  # attempts set to max first: dead
    ("defer", 20.0, "not yet"),
    ("defer", 3600.0, "too late"),  # past max_age: dead
    ("dead", 0.0, "PermanentError: nope"),
    ("error", 40.0, "RuntimeError: boom"),  # a failed attempt (invariant 31): backs off
    ("postpone", 60.0, "unroutable: none here"),
    ("rate_limited", 20.0, "HTTP 429"),
    ("rate_limited", 3600.0, "HTTP 429 for an hour"),  # past max_age: dead
]
MAX_ATTEMPTS, MAX_AGE = 5, 600.0


def _one_row(
    conn: psycopg.Connection[Any], store: Store, i: int, v: int, case: tuple[str, float, str]
) -> None:
    outcome, delay, error = case
    kw: dict[str, Any] = {"max_attempts": MAX_ATTEMPTS}
    match outcome:
        case "done":
            assert steps.done(store, conn, i, v)
        case "retry":
            assert steps.retry(store, conn, i, v, delay=delay, error=error, **kw)
        case "defer":
            assert steps.defer(store, conn, i, v, delay=delay, reason=error, max_age=MAX_AGE)
        case "dead":
            assert steps.dead(store, conn, i, v, error=error)
        case "error":
            assert steps.record_error(store, conn, i, v, error=error, delay=delay, max_attempts=MAX_ATTEMPTS)
        case "postpone":
            assert steps.postpone(store, conn, i, v, delay=delay, error=error)
        case "rate_limited":
            assert steps.rate_limited(store, conn, i, v, delay=delay, reason=error, max_age=MAX_AGE)


def _written(row: dict[str, Any]) -> dict[str, Any]:
    """What a finalizer decides, independent of the row's id and of when it ran."""
    return {
        "status": row["status"],
        "attempts": row["attempts"],
        "last_error": row["last_error"],
        "available_in": None if row["available_in"] is None else round(row["available_in"]),
        "leased": row["lease_until"] is not None,
        "done": row["done_at"] is not None,
    }


def test_invariant_21_one_finalize_writes_what_each_one_row_finalizer_writes(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    n = len(CASES)
    ids = add(conn, 2 * n, table=table)
    claims = {c.id: c.lease_version for c in _claim(conn, store, 2 * n)}
    started = steps.start_many(
        store, conn, list(claims.items()), lease=LONG, max_attempts=10, starter="w:1:a"
    )
    assert len(started) == 2 * n
    singles, batch = ids[:n], ids[n:]
    for i in (singles[2], batch[2]):
        _set(conn, table, i, f"attempts = {MAX_ATTEMPTS}")
    for i, case in zip(singles, CASES, strict=True):
        _one_row(conn, store, i, claims[i], case)
    rows = [Finish(Lease(i, claims[i]), Step(s), d, e) for i, (s, d, e) in zip(batch, CASES, strict=True)]
    won = steps.finish_many(store, conn, rows, max_attempts=MAX_ATTEMPTS, max_age=MAX_AGE).statuses
    assert set(won) == set(batch)
    for one, many, case in zip(singles, batch, CASES, strict=True):
        assert _written(fetch(conn, table, many)) == _written(fetch(conn, table, one)), case
    statuses = [fetch(conn, table, i)["status"] for i in batch]
    assert statuses == [
        *["done", "pending", "dead", "pending", "dead", "dead", "pending", "pending"],
        *["pending", "dead"],
    ]
    errors = [fetch(conn, table, i)["last_error"] for i in batch]
    assert errors[3:5] == ["deferred: not yet", "deferred past max_defer_age: too late"]
    assert errors[8:] == ["rate limited: HTTP 429", "rate limited past max_defer_age: HTTP 429 for an hour"]
    # Fenced: written again, or by a stale claim, it changes nothing.
    assert steps.finish_many(store, conn, rows, max_attempts=MAX_ATTEMPTS, max_age=MAX_AGE).statuses == {}


def test_invariant_21_a_batch_finalize_never_finishes_an_ordered_row(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    # An ordered row's done moves its key's head under the key lock: Store.done does that.
    [first, _second] = add(conn, 2, table=table, key="k")
    [c] = _claim(conn, store, 5)
    assert c.id == first
    steps.start_many(store, conn, [(c.id, c.lease_version)], lease=LONG, max_attempts=5, starter="w:1:a")
    done = [Finish(c.lease, Step.DONE)]
    assert steps.finish_many(store, conn, done, max_attempts=5, max_age=MAX_AGE).statuses == {}
    assert fetch(conn, table, first)["status"] == "processing"


# -- the dispatcher -----------------------------------------------------------------------------


@pytest.fixture
def pool(migrated_dsn: str) -> Iterator[ConnectionPool[Any]]:
    with ConnectionPool(migrated_dsn, min_size=1, max_size=4, kwargs={"autocommit": True}, open=True) as p:
        yield p


def _dispatcher(pool: ConnectionPool[Any], table: str, fn: Any, batch: int = 10) -> InProcess:
    spec = HandlerSpec(EVENT, fn, "q", batch=batch)
    config = OutboxConfig(table=table, backoff_base=0.1, backoff_cap=0.5, done_batch_delay=0)
    return InProcess(config, pool.connection, {EVENT: spec})


def test_claims_of_a_batch_handler_are_cut_into_groups_of_its_size(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    add(conn, 7, table=table, event_type=EVENT)
    dispatcher = _dispatcher(pool, table, lambda msgs: None, batch=3)
    units = claim_units(dispatcher)
    assert [len(u) for u in units] == [3, 3, 1]
    # Grouping the groups again changes nothing (the publisher does it after the claim loop).
    flat = [c for u in units for c in u]
    assert publish_units(flat, dispatcher.handlers, max_attempts=dispatcher.config.max_attempts) == units


def test_invariant_21_a_mixed_batch_records_each_outcome(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    ids = add(conn, 6, table=table, event_type=EVENT)
    seen: list[list[int]] = []

    def handler(msgs: list[Message]) -> dict[int, BaseException]:
        seen.append([m.id for m in msgs])
        return {
            ids[1]: RetryableError("later", delay=30),
            ids[2]: Defer(40, reason="not yet"),
            ids[3]: PermanentError("never"),
            ids[4]: RuntimeError("unclassified"),
        }

    dispatcher = _dispatcher(pool, table, handler)
    [unit] = claim_units(dispatcher)
    counts = dispatcher.deliver_batch([(c.id, c.lease_version) for c in unit])
    assert seen == [ids]
    assert counts == {"done": 2, "retry": 1, "defer": 1, "dead": 1, "error": 1}
    rows = {i: fetch(conn, table, i) for i in ids}
    # The unclassified one is a failed attempt (invariant 31): back after the backoff.
    assert [rows[i]["status"] for i in ids] == ["done", "pending", "pending", "dead", "pending", "done"]
    assert [rows[i]["attempts"] for i in ids] == [1, 1, 0, 1, 1, 1]
    assert 25 < rows[ids[1]]["available_in"] <= 30
    assert rows[ids[3]]["last_error"] == "PermanentError: never"
    assert rows[ids[4]]["last_error"].startswith("RuntimeError: unclassified")


def test_invariant_23_a_rate_limited_item_of_a_batch_holds_its_event_type(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    ids = add(conn, 3, table=table, event_type=EVENT)

    def handler(msgs: list[Message]) -> dict[int, BaseException]:
        return {ids[1]: RateLimited(30, reason="HTTP 429")}

    dispatcher = _dispatcher(pool, table, handler)
    [unit] = claim_units(dispatcher)
    counts = dispatcher.deliver_batch([(c.id, c.lease_version) for c in unit])
    assert counts == {"done": 2, "rate_limited": 1}
    row = fetch(conn, table, ids[1])
    # Back to pending, its attempt refunded, and its whole event type held (not lost as a stale lease).
    assert (row["status"], row["attempts"]) == ("pending", 0)
    assert 25 < row["available_in"] <= 30
    [held] = ops.stats(conn, table).flow
    assert held.event_type == EVENT and held.held_for is not None and held.held_for > 25


def test_invariant_21_an_exception_applies_to_the_whole_batch(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    ids = add(conn, 3, table=table, event_type=EVENT)

    def handler(msgs: list[Message]) -> None:
        raise RetryableError("bulk endpoint down", delay=20)

    dispatcher = _dispatcher(pool, table, handler)
    [unit] = claim_units(dispatcher)
    assert dispatcher.deliver_batch([(c.id, c.lease_version) for c in unit]) == {"retry": 3}
    assert {fetch(conn, table, i)["status"] for i in ids} == {"pending"}

    def broken(msgs: list[Message]) -> None:
        raise RuntimeError("bug")

    _set(conn, table, ids[0], "available_at = now()")
    dispatcher = _dispatcher(pool, table, broken)
    [unit] = claim_units(dispatcher)
    with pytest.raises(RuntimeError):
        dispatcher.deliver_batch([(c.id, c.lease_version) for c in unit])
    row = fetch(conn, table, ids[0])
    assert (row["status"], row["attempts"]) == ("pending", 2)  # a failed attempt (invariant 31)
    assert row["last_error"].startswith("RuntimeError: bug")


@pytest.mark.parametrize("result", [[1, 2], {"x": PermanentError("no")}, {-1: PermanentError("no")}])
def test_a_batch_handler_that_returns_something_else_fails_the_whole_batch(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any], result: object
) -> None:
    ids = add(conn, 2, table=table, event_type=EVENT)
    dispatcher = _dispatcher(pool, table, lambda msgs: result)
    [unit] = claim_units(dispatcher)
    with pytest.raises(TypeError):
        dispatcher.deliver_batch([(c.id, c.lease_version) for c in unit])
    assert {fetch(conn, table, i)["status"] for i in ids} == {"pending"}  # failed attempts
    assert all("TypeError" in fetch(conn, table, i)["last_error"] for i in ids)


def test_invariant_21_ordered_messages_are_at_most_one_per_key_per_batch(
    conn: psycopg.Connection[Any], store: Store, table: str, pool: ConnectionPool[Any]
) -> None:
    a = add(conn, 3, table=table, event_type=EVENT, key="a")
    b = add(conn, 3, table=table, event_type=EVENT, key="b")
    batches: list[list[int]] = []

    def handler(msgs: list[Message]) -> None:
        batches.append([m.id for m in msgs])

    dispatcher = _dispatcher(pool, table, handler)
    for _ in range(3):
        [unit] = claim_units(dispatcher)
        dispatcher.deliver_batch([(c.id, c.lease_version) for c in unit])
    # One head per key per batch, each key in id order; every done moved its key's head.
    assert batches == [[a[0], b[0]], [a[1], b[1]], [a[2], b[2]]]
    assert {fetch(conn, table, i)["status"] for i in a + b} == {"done"}
    assert claim_ids(store, conn) == []


def test_a_batch_finalize_wakes_the_listeners_when_asked(
    conn: psycopg.Connection[Any], store: Store, table: str, connect: Any
) -> None:
    # A batch's leases end together: the claim that the in-flight bound stopped should run again.
    listener = connect()
    store.listen(listener)
    ids = add(conn, 2, table=table)
    list(listener.notifies(timeout=0.2))  # the producer's own notification, if any
    claims = {c.id: c.lease_version for c in _claim(conn, store, 2)}
    steps.start_many(store, conn, list(claims.items()), lease=LONG, max_attempts=5, starter="w:1:a")
    quiet = [Finish(Lease(ids[0], claims[ids[0]]), Step.DONE)]
    steps.finish_many(store, conn, quiet, max_attempts=5, max_age=MAX_AGE)
    assert list(listener.notifies(timeout=0.3)) == []
    loud = [Finish(Lease(ids[1], claims[ids[1]]), Step.DONE)]
    steps.finish_many(store, conn, loud, max_attempts=5, max_age=MAX_AGE, notify=True)
    assert len(list(listener.notifies(timeout=2.0, stop_after=1))) == 1


# -- max_wait: a batch fills briefly at low rates -----------------------------------------

OTHER = "thing.other"


def _fill_claim(
    conn: psycopg.Connection[Any],
    store: Store,
    *,
    batch: int = 10,
    max_wait: float = 1.0,
    limit: int = 100,
    marks: ScanMarks | None = None,
) -> ClaimResult:
    return steps.claim(
        store,
        conn,
        limit=limit,
        lease=LONG,
        owner="w",
        max_attempts=5,
        marks=marks,
        fill={EVENT: (batch, max_wait)},
    )


def test_invariant_21_max_wait_holds_a_thin_batch_until_its_oldest_row_has_waited_it(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    marks = ScanMarks(lookback=2.0, full_every=3600.0)
    ids = add(conn, 3, table=table, event_type=EVENT)
    [other] = add(conn, 1, table=table, event_type=OTHER)
    first = _fill_claim(conn, store, marks=marks)
    # Three due rows of a batch of 10, due for less than max_wait: none taken, other types flow,
    # and the claim says when to come back (the oldest row's due time + max_wait, DB clock).
    assert [c.id for c in first.claimed] == [other]
    assert first.filling == (EVENT,)
    assert first.flow_wait is not None and 0.5 < first.flow_wait <= 1.0
    assert {fetch(conn, table, i)["status"] for i in ids} == {"pending"}
    passes = marks.full_passes
    time.sleep(first.flow_wait + 0.05)
    again = _fill_claim(conn, store, marks=marks)
    assert sorted(c.id for c in again.claimed) == ids
    assert again.filling == () and again.flow_wait is None
    # Found from the scan marks, not by a full pass: the rows waited less than scan_lookback.
    assert marks.full_passes == passes


def test_invariant_21_max_wait_a_full_batch_is_taken_at_once(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    ids = add(conn, 10, table=table, event_type=EVENT)
    result = _fill_claim(conn, store, max_wait=5.0)
    assert sorted(c.id for c in result.claimed) == ids
    assert result.filling == () and result.flow_wait is None
    # Fewer rows than a batch but as many as the claim may take (the in-flight room): at once too.
    few = add(conn, 3, table=table, event_type=EVENT)
    assert sorted(c.id for c in _fill_claim(conn, store, max_wait=5.0, limit=3).claimed) == few


def test_invariant_21_max_wait_never_holds_ordered_heads_nor_other_types(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    [head, _follower] = add(conn, 2, table=table, event_type=EVENT, key="k")
    add(conn, 2, table=table, event_type=EVENT)
    others = add(conn, 2, table=table, event_type=OTHER)
    result = _fill_claim(conn, store, max_wait=5.0)
    # The unordered rows wait to fill a batch; a key's head never does (it would hold its key).
    assert sorted(c.id for c in result.claimed) == sorted([head, *others])
    assert result.filling == (EVENT,)


def test_invariant_21_max_wait_zero_or_a_paused_type_is_not_read(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    ids = add(conn, 2, table=table, event_type=EVENT)
    result = _fill_claim(conn, store, max_wait=0.0)
    assert sorted(c.id for c in result.claimed) == ids and result.filling == ()
    ops.pause(conn, table, EVENT)
    add(conn, 2, table=table, event_type=EVENT)
    paused = _fill_claim(conn, store, max_wait=5.0)
    assert paused.claimed == [] and paused.filling == () and paused.held == (EVENT,)


def test_max_wait_in_the_claim_run_sets_when_the_listener_claims_again(
    conn: psycopg.Connection[Any], table: str, pool: ConnectionPool[Any]
) -> None:
    add(conn, 2, table=table, event_type=EVENT)
    spec = HandlerSpec(EVENT, lambda msgs: None, "q", batch=10, max_wait=0.5)
    config = OutboxConfig(table=table, done_batch_delay=0)
    dispatcher = InProcess(config, pool.connection, {EVENT: spec})
    published: list[Claimed] = []

    def publish(claims: Sequence[Claimed]) -> int:
        published.extend(claims)
        return len(claims)

    run = dispatcher.claim_and_publish(publish, owner="test")
    assert published == [] and run.flow_wait is not None and 0 < run.flow_wait <= 0.5
    time.sleep(run.flow_wait + 0.05)
    dispatcher.claim_and_publish(publish, owner="test")
    assert len(published) == 2


def test_invariant_21_max_wait_never_holds_expired_leases(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    # A started claim whose worker died: its rows waited a lease already and come back at once.
    ids = add(conn, 2, table=table, event_type=EVENT)
    claims = steps.claim(store, conn, limit=10, lease=SHORT, owner="w", max_attempts=5).claimed
    pairs = [(c.id, c.lease_version) for c in claims]
    steps.start_many(store, conn, pairs, lease=SHORT, max_attempts=5, starter="w:1:a")
    time.sleep(PAST_SHORT)
    again = _fill_claim(conn, store, max_wait=5.0)
    assert sorted(c.id for c in again.claimed) == ids
    assert {c.lease_version for c in again.claimed} == {2}
