"""Small helpers shared by the integration tests: insert rows, read what PostgreSQL holds."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from support import steps

from outbox_celery import Event, Store, TableName, enqueue_many
from outbox_celery.claim.executor import Claimed, ClaimResult, ScanMarks
from outbox_celery.claim.units import publish_units
from outbox_celery.flow import Limit
from outbox_celery.testing import InProcess

# Generous default lease for claims that must not expire during a test.
LONG = 60.0
# Short lease for tests that let leases expire (every comparison uses the database clock).
SHORT = 0.2
# A little more than SHORT: after sleeping this long a SHORT lease has expired.
PAST_SHORT = 0.3

Connect = Callable[[], psycopg.Connection[Any]]


def add(
    conn: psycopg.Connection[Any],
    n: int = 1,
    *,
    table: str = "outbox",
    event_type: str = "thing.happened",
    key: str | None = None,
    delay: float | None = None,
    payload: Callable[[int], Any] | None = None,
    limit_key: str | None = None,
) -> list[int]:
    """Commit ``n`` events (``payload(i)`` or ``{"i": i}``); ``key`` makes them ordered;
    ``limit_key`` is their limit key (DESIGN invariant 24)."""
    events = [
        Event(
            event_type=event_type,
            payload=payload(i) if payload else {"i": i},
            aggregate_type="thing",
            aggregate_id=str(i),
            ordering_key=key,
            delay=delay,
            limit_key=limit_key,
        )
        for i in range(n)
    ]
    with conn.transaction():
        return enqueue_many(conn, events, table=table)


def fetch(conn: psycopg.Connection[Any], table: str, outbox_id: int) -> dict[str, Any]:
    """One row as PostgreSQL holds it, plus seconds from the database's now() to its times."""
    query = sql.SQL(
        "SELECT *, extract(epoch FROM available_at - now())::float8 AS available_in,"
        " extract(epoch FROM lease_until - now())::float8 AS lease_in"
        " FROM {} WHERE id = %s"
    ).format(TableName.parse(table).identifier())
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(query, [outbox_id]).fetchone()
    assert row is not None, f"row {outbox_id} is gone"
    return row


def fetch_all(conn: psycopg.Connection[Any], table: str) -> list[dict[str, Any]]:
    """Every row, by id, with the same computed columns as :func:`fetch`."""
    query = sql.SQL(
        "SELECT *, extract(epoch FROM available_at - now())::float8 AS available_in,"
        " extract(epoch FROM lease_until - now())::float8 AS lease_in"
        " FROM {} ORDER BY id"
    ).format(TableName.parse(table).identifier())
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query).fetchall()


def stable(row: dict[str, Any]) -> dict[str, Any]:
    """A row without the columns computed against now(), for before/after comparisons."""
    return {k: v for k, v in row.items() if k not in ("available_in", "lease_in")}


def count(conn: psycopg.Connection[Any], table: str, where: str = "true") -> int:
    """``SELECT count(*)`` with a literal condition written by the test itself."""
    query = sql.SQL("SELECT count(*) FROM {} WHERE " + where).format(TableName.parse(table).identifier())
    row = conn.execute(query).fetchone()
    assert row is not None
    return int(row[0])


def claim_ids(
    store: Store,
    conn: psycopg.Connection[Any],
    *,
    limit: int = 100,
    lease: float = LONG,
    max_attempts: int = 5,
    owner: str = "test",
) -> list[int]:
    """Ids of one claim, in the order the claim returned them."""
    result = steps.claim(store, conn, limit=limit, lease=lease, owner=owner, max_attempts=max_attempts)
    return [c.id for c in result.claimed]


T = TypeVar("T")


def in_threads(n: int, body: Callable[[threading.Barrier], None], *, timeout: float = 120.0) -> None:
    """Run ``body`` in ``n`` threads at once, each given the barrier they share; an exception in
    one aborts the barrier (the others stop waiting) and fails the caller."""
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            body(barrier)
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors


def claim_together(
    connect: Connect,
    table: str,
    limits: Mapping[str, Any],
    observe: Callable[[psycopg.Connection[Any]], T],
    *,
    claimers: int,
    rounds: int,
) -> list[T]:
    """``claimers`` threads, each on its own connection, claim at the same moment ``rounds``
    times; after each claim (all of them done) every thread records ``observe(conn)``, then
    finishes what it took so the next round claims again. Returns what was observed."""
    seen: list[T] = []
    lock = threading.Lock()

    def run(barrier: threading.Barrier) -> None:
        c = connect()
        s = Store(table)
        for _ in range(rounds):
            barrier.wait(10)
            got = steps.claim(s, c, limit=50, lease=LONG, owner="t", max_attempts=5, limits=limits).claimed
            barrier.wait(10)
            with lock:
                seen.append(observe(c))
            barrier.wait(10)
            for g in got:
                assert steps.done(s, c, g.id, g.lease_version)

    in_threads(claimers, run)
    assert len(seen) == claimers * rounds
    return seen


def claim(
    store: Store,
    conn: psycopg.Connection[Any],
    *,
    limits: dict[str, Limit] | None = None,
    limit: int = 100,
    marks: ScanMarks | None = None,
    lease: float = LONG,
) -> ClaimResult:
    """One claim run as the flow-control tests make it (owner ``test``, 5 attempts)."""
    return steps.claim(
        store, conn, limit=limit, lease=lease, owner="test", max_attempts=5, limits=limits, marks=marks
    )


def claim_units(dispatcher: InProcess) -> list[list[Claimed]]:
    """One claim run of ``dispatcher``; the delivery tasks it would publish (publish_units)."""
    units: list[list[Claimed]] = []

    def publish(claims: Sequence[Claimed]) -> int:
        units.extend(publish_units(claims, dispatcher.handlers, max_attempts=dispatcher.config.max_attempts))
        return len(claims)

    dispatcher.claim_and_publish(publish, owner="test")
    return units


def lock_waiters(conn: psycopg.Connection[Any]) -> int:
    """How many sessions of the database wait for a lock now."""
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    ).fetchone()
    return int(row[0]) if row else 0


class Recording(psycopg.Cursor[Any]):
    """A cursor that records every statement it runs (the test's psycopg trace); a connection
    made with ``cursor_factory=Recording`` runs every statement through it."""

    seen: list[str] = []

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        text = query if isinstance(query, str) else query.as_string(self.connection)
        Recording.seen.append(text)
        return super().execute(query, params, **kwargs)

    @classmethod
    def names(cls) -> list[str]:
        """The library's statements seen, by the name each carries (``/* outbox-celery x */``)."""
        return [m.group(1) for q in cls.seen if (m := re.match(r"/\* outbox-celery (\S+) \*/", q))]
