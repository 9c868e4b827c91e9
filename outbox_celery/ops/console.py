"""The operator console's reads and bulk actions: bounded, whatever the table's size.

What :mod:`outbox_celery.web` shows. Every read of live rows goes through one partial index and
stops after ``cap`` entries (``sql/console.sql``), so a page costs the same with 2 million done
rows as with none; a figure that reached the cap is a lower bound (:class:`Count`). Actions reuse
:mod:`outbox_celery.ops` (requeue, skip, pause, resume): a bulk action by filter runs batch by batch,
each batch its own short transaction.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from ..config import TableName
from ..db import statements as _sql
from ..errors import AdminError
from ._queries import many, one, values
from .dead import SKIPPED_BY_OPERATOR, requeue, skip
from .flow import FlowState, KeyFlowState, flow_states, key_states
from .retention import Horizon, horizon

__all__ = [
    "DEFAULT_CAP",
    "DEFAULT_MINUTE_CAP",
    "BlockedKey",
    "BulkResult",
    "Count",
    "DeadQuery",
    "DeadRow",
    "KeyUse",
    "Minute",
    "Overview",
    "TypeCounts",
    "bulk_dead",
    "count_dead",
    "list_dead",
    "minutes",
    "overview",
    "task_ids",
]

#: Index entries a count reads at most per status (figures past it read "10,000+").
DEFAULT_CAP = 10_000
#: Done rows the chart reads at most per minute.
DEFAULT_MINUTE_CAP = 2_000
#: Rows one batch of a bulk action locks at most (each batch is its own transaction).
BULK_BATCH = 200


@functools.cache
def _queries(table: TableName) -> Mapping[str, sql.Composed]:
    return _sql.queries("console.sql", table)


def _q(table: str | TableName, name: str) -> sql.Composed:
    return _queries(TableName.parse(table))[name]


@dataclass(frozen=True, slots=True)
class Count:
    """A bounded count: ``value`` rows, or at least that many when ``capped``."""

    value: int
    capped: bool = False

    def __str__(self) -> str:
        return f"{self.value:,}+" if self.capped else f"{self.value:,}"


@dataclass(frozen=True, slots=True)
class TypeCounts:
    """The live messages of one event type, as the console's bounded reads see them.

    :ivar ready: pending, due, and in turn (unordered, or the head of its key).
    :ivar in_flight: processing (claimed, published or running).
    :ivar retrying: pending until a backoff ends (attempts spent).
    :ivar scheduled: pending until a delay or a defer ends (no attempt spent).
    :ivar behind_key: ordered messages waiting behind their key's head.
    :ivar dead: dead letters.
    :ivar oldest_ready_wait: seconds the oldest ready message has been due (``None``: none).
    """

    event_type: str
    ready: Count
    in_flight: Count
    retrying: Count
    scheduled: Count
    behind_key: Count
    dead: Count
    oldest_ready_wait: float | None


@dataclass(frozen=True, slots=True)
class BlockedKey:
    """An ordering key whose head is dead: the dead head blocks every message behind it."""

    ordering_key: str
    #: The dead head's id.
    id: int
    event_type: str


@dataclass(frozen=True, slots=True)
class KeyUse:
    """Live leases of one limit key (``in_flight``)."""

    event_type: str
    limit_key: str
    in_flight: int


@dataclass(frozen=True, slots=True)
class Overview:
    """One table at a glance (see :func:`overview`)."""

    now: datetime
    cap: int
    event_types: list[TypeCounts]
    totals: TypeCounts
    paused: list[FlowState]
    held_keys: list[KeyFlowState]
    blocked_keys: list[BlockedKey]
    headless_keys: Count
    horizon: Horizon
    key_use: list[KeyUse]


def _count(*, keys: int, capped: bool) -> Count:
    """A row of ``console_headless``: ordering keys without a head among those read."""
    return Count(int(keys), bool(capped))


def overview(
    conn: psycopg.Connection[Any], table: str | TableName = "outbox", *, cap: int = DEFAULT_CAP
) -> Overview:
    """Counts per event type, holds, blocked and headless keys and the xmin horizon.

    Each status is read from its partial index up to ``cap`` entries (a bounded read, never a
    scan of the history): a count that reached the cap is a lower bound (``Count.capped``).
    """
    if cap < 1:
        raise AdminError("cap must be at least 1")
    t = TableName.parse(table)
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(_q(t, "console_counts"), {"cap": cap}).fetchone()
    assert row is not None
    headless = one(conn, _q(t, "console_headless"), {"cap": cap}, _count)
    assert headless is not None
    blocked = many(conn, _q(t, "console_blocked"), {"cap": 100}, BlockedKey)
    key_use = many(conn, _q(t, "console_key_use"), {"cap": cap}, KeyUse)
    capped = {
        "ready": row["ready_capped"],
        "retrying": row["later_capped"],
        "scheduled": row["later_capped"],
        "behind_key": row["behind_key_capped"],
        "in_flight": row["in_flight_capped"],
        "dead": row["dead_capped"],
    }
    fields = ("ready", "in_flight", "retrying", "scheduled", "behind_key", "dead")
    types = [
        TypeCounts(
            event_type=str(e["event_type"]),
            **{f: Count(int(e[f]), bool(capped[f])) for f in fields},
            oldest_ready_wait=e["oldest_ready_wait"],
        )
        for e in row["event_types"]
    ]
    waits = [e.oldest_ready_wait for e in types if e.oldest_ready_wait is not None]
    totals = TypeCounts(
        event_type="all",
        **{f: Count(sum(getattr(e, f).value for e in types), bool(capped[f])) for f in fields},
        oldest_ready_wait=max(waits) if waits else None,
    )
    return Overview(
        now=row["now"],
        cap=cap,
        event_types=types,
        totals=totals,
        paused=flow_states(conn, t),
        held_keys=key_states(conn, t),
        blocked_keys=blocked,
        headless_keys=headless,
        horizon=horizon(conn, t),
        key_use=key_use,
    )


@dataclass(frozen=True, slots=True)
class Minute:
    """Done messages finished in one minute, and their enqueue -> done latency (seconds)."""

    minute: datetime
    done: int
    capped: bool
    p50: float | None
    p99: float | None


def minutes(
    conn: psycopg.Connection[Any], table: str | TableName = "outbox", *, minute_cap: int = DEFAULT_MINUTE_CAP
) -> list[Minute]:
    """The last hour, minute by minute (the database's clock): done count and latency.

    Latency is ``done_at - created_at``: from the producing transaction's ``now()`` to the
    fenced done, so it includes the producer's transaction, delays, retries and backoffs. The
    row records no start time, so commit -> start is not measurable from the table. Each
    minute reads at most ``minute_cap`` done rows (a capped minute's count is a lower bound).
    """
    params = {"minute_cap": minute_cap, "skip_like": SKIPPED_BY_OPERATOR + ": %"}
    return many(conn, _q(table, "console_minutes"), params, Minute)


@dataclass(frozen=True, slots=True)
class DeadQuery:
    """The console's dead-letter filter; empty fields match everything.

    :ivar key: an ordering key, a limit key or an aggregate id; a producer's ordering key also
        matches its subscriptions' rows (stored as ``<key>`` chr(31) route, DESIGN invariant 28).
    :ivar error: text found in the last error (case-insensitive).
    :ivar payload: text found in the payload's JSON (case-insensitive), the payload its handler
        receives: a subscription's row that is not the owner is found by its owner's payload.
        A UUID (``1b4e28ba-2fa1-...``) also finds the 32 hex digits kombu stores it as.
    :ivar upto: only ids up to this one (a bulk action is bounded by the count it confirmed).
    """

    event_type: str | None = None
    key: str | None = None
    error: str | None = None
    payload: str | None = None
    upto: int | None = None

    def params(self) -> dict[str, Any]:
        """The query parameters (empty text is no filter)."""
        return {
            "event_type": self.event_type or None,
            "key": self.key or None,
            "error": self.error or None,
            "payload": self.payload or None,
            "payload_uuid": _uuid_hex(self.payload),
            "upto": self.upto,
        }


def _uuid_hex(text: str | None) -> str | None:
    """The hex form kombu's JSON stores a UUID as (``{"__type__": "uuid", "__value__": {"hex":
    ...}}``), when ``text`` is a UUID; ``None`` otherwise."""
    if not text:
        return None
    try:
        return uuid.UUID(text.strip()).hex
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class DeadRow:
    """A dead message as the console lists it: its last error (300 characters) and its
    payload's JSON (200) shortened; ``age`` in seconds since ``created_at``.

    :ivar payload: the stored JSON text of the payload its handler receives (a subscription's
        row: its owner's), cut to 200 characters.
    :ivar payload_json: that payload whole, as psycopg loads it, when its text is at most 2,000
        characters (``None`` otherwise): what a page decodes (:func:`outbox_celery.codec.decode`).
    """

    id: int
    event_type: str
    aggregate_type: str
    aggregate_id: str
    ordering_key: str | None
    limit_key: str | None
    attempts: int
    created_at: datetime
    age: float
    last_error: str | None
    payload: str | None
    payload_json: Any = None


class _Matching(NamedTuple):
    """A row of ``console_dead_count``: how many match, and the highest id among them."""

    n: int
    upto: int | None


def list_dead(
    conn: psycopg.Connection[Any],
    table: str | TableName,
    query: DeadQuery,
    *,
    after: int = 0,
    limit: int = 50,
) -> list[DeadRow]:
    """One page of matching dead messages by id (error and payload shortened)."""
    params = {**query.params(), "after": after, "limit": limit}
    return many(conn, _q(table, "console_dead_list"), params, DeadRow)


def count_dead(
    conn: psycopg.Connection[Any], table: str | TableName, query: DeadQuery
) -> tuple[int, int | None]:
    """How many dead messages match, and the highest matching id (``None`` when none)."""
    row = one(conn, _q(table, "console_dead_count"), query.params(), _Matching)
    assert row is not None
    return int(row.n), None if row.upto is None else int(row.upto)


@dataclass(frozen=True, slots=True)
class BulkResult:
    """What a bulk action did: rows changed, batches run (each its own transaction)."""

    changed: int
    batches: int


def bulk_dead(
    conn: psycopg.Connection[Any],
    table: str | TableName,
    query: DeadQuery,
    *,
    action: str,
    reason: str,
    batch_size: int = BULK_BATCH,
) -> BulkResult:
    """Requeue or skip every dead message matching ``query`` (ids up to ``query.upto``).

    Batch by batch in id order through :func:`~outbox_celery.ops.dead.requeue` /
    :func:`~outbox_celery.ops.dead.skip` (each batch one short transaction, its rows locked for
    milliseconds). A row another operator changed meanwhile makes its batch refuse and is left
    out on the next read. ``conn`` must not be inside a transaction.
    """
    if action not in ("requeue", "skip"):
        raise AdminError(f"unknown action {action!r}")
    if query.upto is None:
        raise AdminError("a bulk action needs the highest id it confirmed (upto)")
    changed = batches = 0
    after, refusals = 0, 0
    while True:
        params = {**query.params(), "after": after, "limit": batch_size}
        ids = [int(i) for i in values(conn, _q(table, "console_dead_ids"), params)]
        if not ids:
            break
        try:
            if action == "requeue":
                done = requeue(conn, table, ids, reason=reason)
            else:
                done = skip(conn, table, ids, reason=reason)
        except AdminError:
            # Raced by another operator or worker: read the batch again (the rows that are no
            # longer dead drop out); give up after a few tries rather than loop.
            refusals += 1
            if refusals > 3:
                raise
            continue
        changed += len(done)
        batches += 1
        after = ids[-1]
        if len(ids) < batch_size:
            break
    return BulkResult(changed, batches)


def task_ids(table: str | TableName, outbox_id: int, lease_version: int) -> list[str]:
    """The Celery task id of each claim of a message: ``<table>:<id>:v<n>`` for n = 1..version.

    The publisher derives it from the claim (:meth:`TaskPublisher.task_id`); a batch task's id
    is its first claim's plus ``+<size>``, so a batched message's own id may not appear in Flower.
    """
    qualified = TableName.parse(table).qualified
    return [f"{qualified}:{outbox_id}:v{v}" for v in range(1, lease_version + 1)]
