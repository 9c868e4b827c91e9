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
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

import psycopg
from psycopg import sql

from ..config import OutboxConfig
from ..db import statements as _sql
from ..errors import AdminError
from ..table import TableName
from ._queries import many, one, value, values
from .dead import SKIPPED_BY_OPERATOR, requeue, skip
from .durations import format_duration, overdue_after
from .flow import FlowState, KeyFlowState, flow_states, key_states
from .horizon import Horizon, horizon

__all__ = [
    "COUNT_PARTS",
    "DEFAULT_CAP",
    "DEFAULT_MINUTE_CAP",
    "STATES",
    "BlockedKey",
    "BulkResult",
    "Count",
    "CountPart",
    "DeadPage",
    "DeadQuery",
    "DeadRow",
    "Flag",
    "Holds",
    "KeyUse",
    "Minute",
    "Overview",
    "StateRow",
    "TypeCounts",
    "assemble",
    "bulk_dead",
    "count_dead",
    "count_part",
    "dead_page",
    "flags",
    "holds",
    "list_dead",
    "list_state",
    "minutes",
    "overview",
    "subscription_routes",
    "task_ids",
]

#: Index entries a count reads at most per status (figures past it read "10,000+").
DEFAULT_CAP = 10_000
#: Done rows the chart reads at most per minute.
DEFAULT_MINUTE_CAP = 2_000
#: Rows one batch of a bulk action locks at most (each batch is its own transaction).
BULK_BATCH = 200
#: The overview's states that :func:`list_state` lists (dead letters: :func:`list_dead`).
STATES = ("ready", "in_flight", "retrying", "scheduled", "behind_key")


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
    :ivar unstarted: pending or in-flight messages claimed since their last start without a
        worker starting them (stats' rule: a live lease's own claim does not count yet).
    :ivar expired: in-flight messages whose lease ran out (a worker lost or stuck).
    """

    event_type: str
    ready: Count
    in_flight: Count
    retrying: Count
    scheduled: Count
    behind_key: Count
    dead: Count
    oldest_ready_wait: float | None
    unstarted: int = 0
    expired: int = 0

    @property
    def pending(self) -> int:
        """Pending messages read: ready, retrying, scheduled and behind a key."""
        return sum(c.value for c in (self.ready, self.retrying, self.scheduled, self.behind_key))


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
    #: The subscriptions' routes, each with whether it is live (not removed); ``None`` before
    #: migration 0011.
    routes: Mapping[str, bool] | None = None


def _count(*, keys: int, capped: bool) -> Count:
    """A row of ``console_headless``: ordering keys without a head among those read."""
    return Count(int(keys), bool(capped))


#: The overview's counts, in parts: each one statement over its own indexes (ready; retrying and
#: scheduled; behind a key, in flight and dead). :func:`overview` reads them one after another;
#: a console reads them at once on several connections (:func:`count_part`, :func:`assemble`).
COUNT_PARTS = ("ready", "later", "rest")
_KINDS = ("ready", "in_flight", "retrying", "scheduled", "behind_key", "dead")


@dataclass(frozen=True, slots=True)
class CountPart:
    """One part of the overview's counts (:data:`COUNT_PARTS`), as its statement read it.

    :ivar capped: per kind it counts, whether a read of it stopped at the cap.
    :ivar counts: per kind and event type: ``what``, ``event_type``, ``n``,
        ``oldest_ready_wait``, ``unstarted``, ``expired``.
    """

    now: datetime
    capped: dict[str, bool]
    counts: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Holds:
    """What the overview shows beside the counts: what holds messages back, the key leases in
    use, the xmin horizon and the subscriptions' routes (see :class:`Overview`)."""

    paused: list[FlowState]
    held_keys: list[KeyFlowState]
    blocked_keys: list[BlockedKey]
    headless_keys: Count
    horizon: Horizon
    key_use: list[KeyUse]
    routes: Mapping[str, bool] | None


def count_part(
    conn: psycopg.Connection[Any], table: str | TableName, part: str, *, cap: int = DEFAULT_CAP
) -> CountPart:
    """Read one part of :func:`overview`'s counts (``part`` in :data:`COUNT_PARTS`): at most
    ``cap`` entries of each of its partial indexes."""
    if part not in COUNT_PARTS:
        raise AdminError(f"unknown part {part!r}: one of {', '.join(COUNT_PARTS)}")
    if cap < 1:
        raise AdminError("cap must be at least 1")
    row = one(conn, _q(table, f"console_counts_{part}"), {"cap": cap}, CountPart)
    assert row is not None
    return row


def holds(conn: psycopg.Connection[Any], table: str | TableName, *, cap: int = DEFAULT_CAP) -> Holds:
    """What :func:`overview` shows beside the counts, each read bounded by ``cap``."""
    t = TableName.parse(table)
    headless = one(conn, _q(t, "console_headless"), {"cap": cap}, _count)
    assert headless is not None
    return Holds(
        paused=flow_states(conn, t),
        held_keys=key_states(conn, t),
        blocked_keys=many(conn, _q(t, "console_blocked"), {"cap": 100}, BlockedKey),
        headless_keys=headless,
        horizon=horizon(conn, t),
        key_use=many(conn, _q(t, "console_key_use"), {"cap": cap}, KeyUse),
        routes=subscription_routes(conn, t),
    )


def assemble(parts: Collection[CountPart], held: Holds, *, cap: int) -> Overview:
    """The :class:`Overview` of the parts of its counts (one of each of :data:`COUNT_PARTS`)
    and what holds messages back."""
    capped = {kind: bool(c) for p in parts for kind, c in p.capped.items()}
    by_type: dict[str, dict[str, Any]] = {}
    for p in parts:
        for c in p.counts:
            e = by_type.setdefault(c["event_type"], {"oldest_ready_wait": None, "unstarted": 0, "expired": 0})
            e[c["what"]] = int(c["n"])
            if c["what"] == "ready":
                e["oldest_ready_wait"] = c["oldest_ready_wait"]
            e["unstarted"] += int(c["unstarted"])
            e["expired"] += int(c["expired"])
    types = [
        TypeCounts(
            event_type=event_type,
            **{k: Count(e.get(k, 0), capped.get(k, False)) for k in _KINDS},
            oldest_ready_wait=e["oldest_ready_wait"],
            unstarted=e["unstarted"],
            expired=e["expired"],
        )
        for event_type, e in sorted(by_type.items())
    ]
    waits = [e.oldest_ready_wait for e in types if e.oldest_ready_wait is not None]
    totals = TypeCounts(
        event_type="all",
        **{k: Count(sum(getattr(e, k).value for e in types), capped.get(k, False)) for k in _KINDS},
        oldest_ready_wait=max(waits) if waits else None,
        unstarted=sum(e.unstarted for e in types),
        expired=sum(e.expired for e in types),
    )
    return Overview(
        now=max(p.now for p in parts),
        cap=cap,
        event_types=types,
        totals=totals,
        paused=held.paused,
        held_keys=held.held_keys,
        blocked_keys=held.blocked_keys,
        headless_keys=held.headless_keys,
        horizon=held.horizon,
        key_use=held.key_use,
        routes=held.routes,
    )


def overview(
    conn: psycopg.Connection[Any], table: str | TableName = "outbox", *, cap: int = DEFAULT_CAP
) -> Overview:
    """Counts per event type, holds, blocked and headless keys and the xmin horizon.

    Each status is read from its partial index up to ``cap`` entries (a bounded read, never a
    scan of the history): a count that reached the cap is a lower bound (``Count.capped``). The
    counts are the parts of :data:`COUNT_PARTS`, read one after another here.
    """
    parts = [count_part(conn, table, p, cap=cap) for p in COUNT_PARTS]
    return assemble(parts, holds(conn, table, cap=cap), cap=cap)


def subscription_routes(conn: psycopg.Connection[Any], table: str | TableName) -> dict[str, bool] | None:
    """Every subscription's route (``<event_type>@<name>``) and whether it is live (not removed):
    what the database knows of who handles an event type (DESIGN invariant 28). ``None`` before
    migration 0011. The subscription table holds one row per subscription ever added."""
    t = TableName.parse(table)
    exists = {"subscription_table": t.identifier(_sql.SUBSCRIPTION_SUFFIX).as_string(conn)}
    if not value(conn, _subscription_queries(t)["exists"], exists):
        return None
    return {str(r): bool(live) for r, live in many(conn, _q(t, "console_routes"), None, _route)}


@functools.cache
def _subscription_queries(table: TableName) -> Mapping[str, sql.Composed]:
    return _sql.queries("subscriptions.sql", table)


def _route(*, route: str, live: bool) -> tuple[str, bool]:
    return route, live


@dataclass(frozen=True, slots=True)
class Flag:
    """Something about one event type that needs a human, as ``outbox-celery stats``' attention
    line says it (the console shows it in red).

    :ivar kind: ``unroutable`` (no handler or subscription takes its pending messages),
        ``unclaimed`` (ready longer than a claim interval and a margin: no claim took it),
        ``unstarted`` (claimed, and no worker started the task) or ``expired`` (leases ran out
        in flight).
    """

    event_type: str
    kind: str
    text: str


def flags(
    ov: Overview, *, handlers: Collection[str] | None = None, claim_interval: float | None = None
) -> list[Flag]:
    """What needs a human among ``ov``'s event types, by ``stats``' rules.

    :param handlers: the routes the app handles (``-A``): a type with pending messages and no
        handler is unroutable. ``None`` (no app): what the database knows decides, a route
        whose subscription was removed or never existed, a plain type whose subscriptions took
        over (a type has one handler or subscriptions, never both), and a ready message nobody
        claimed past :func:`~outbox_celery.ops.durations.overdue_after` the claim interval.
    :param claim_interval: the app's ``claim_interval`` (default: the default configuration's).
    """
    interval = OutboxConfig().claim_interval if claim_interval is None else claim_interval
    overdue = overdue_after(interval)
    # Paused and held types are left unclaimed on purpose (stats does not report them either).
    waiting = {f.event_type for f in ov.paused}
    out = []
    for e in ov.event_types:
        why = _unroutable(e.event_type, handlers, ov.routes) if e.pending else None
        wait = e.oldest_ready_wait
        if why is not None:
            out.append(Flag(e.event_type, "unroutable", why))
        elif wait is not None and wait > overdue and e.event_type not in waiting:
            cause = (
                "is a worker consuming the claim queue running, and beat?"
                if handlers is not None
                else "no claim worker running (a worker consuming the claim queue, and beat), "
                "or no handler for it in the app that claims"
            )
            out.append(
                Flag(e.event_type, "unclaimed", f"ready for {format_duration(wait)}, unclaimed: {cause}")
            )
        if e.unstarted:
            out.append(
                Flag(
                    e.event_type,
                    "unstarted",
                    f"{e.unstarted} message(s) claimed without a worker starting them: "
                    "does its queue have a consumer?",
                )
            )
        if e.expired:
            out.append(
                Flag(
                    e.event_type,
                    "expired",
                    f"{e.expired} lease(s) expired in flight (workers lost or stuck?)",
                )
            )
    return out


def _unroutable(
    event_type: str, handlers: Collection[str] | None, routes: Mapping[str, bool] | None
) -> str | None:
    """Why no handler takes ``event_type``'s pending messages, or ``None`` (one does, or the
    console cannot tell)."""
    if handlers is not None:
        if event_type in handlers:
            return None
        return "no handler in the app: its messages are never delivered (unroutable)"
    if routes is None:
        return None
    if "@" in event_type:
        live = routes.get(event_type)
        if live is None:
            return "no such subscription: no handler takes this route"
        return None if live else "subscription removed: no handler takes its rows (skip or purge them)"
    if any(live and r.startswith(event_type + "@") for r, live in routes.items()):
        return "the type has subscriptions: no handler takes its rows under the plain type"
    return None


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
class _Listed:
    """What every list of the console shows of a message; ``age`` in seconds since
    ``created_at``."""

    id: int
    event_type: str
    aggregate_type: str
    aggregate_id: str
    ordering_key: str | None
    limit_key: str | None
    attempts: int
    created_at: datetime
    age: float


@dataclass(frozen=True, slots=True)
class StateRow(_Listed):
    """A live message as :func:`list_state` lists it (times in seconds from now: negative
    ``available_in`` is how long it has been due, negative ``lease_expires_in`` how long its
    lease has been over); ``last_error`` cut to 300 characters."""

    available_in: float
    lease_expires_in: float | None
    #: Claims since its last start (lease_version - started_version).
    unstarted_claims: int
    last_error: str | None


def list_state(
    conn: psycopg.Connection[Any],
    table: str | TableName,
    state: str,
    *,
    event_type: str | None = None,
    after: int = 0,
    limit: int = 50,
    cap: int = DEFAULT_CAP,
) -> tuple[list[StateRow], int]:
    """One page of the messages behind one figure of :func:`overview` (``state`` in
    :data:`STATES`), by id after ``after``, and how many match.

    Read as :func:`overview` reads them: the first ``cap`` entries of the state's partial
    indexes, then those of ``event_type`` (``None``: every type). So the count is the figure
    the overview shows, a lower bound past the cap, and each page costs at most ``cap`` index
    entries whatever the table holds.
    """
    if state not in STATES:
        raise AdminError(f"unknown state {state!r}: one of {', '.join(STATES)}")
    if cap < 1 or limit < 1:
        raise AdminError("cap and limit must be at least 1")
    params = {"state": state, "event_type": event_type, "after": after, "limit": limit, "cap": cap}
    read = many(conn, _q(table, "console_state_rows"), params, _state_row)
    return [r for _, r in read if r is not None], int(read[0][0]) if read else 0


def _state_row(*, matching: int, **row: Any) -> tuple[int, StateRow | None]:
    """A row of ``console_state_rows``: the count, and the row (``None``: an empty page)."""
    return matching, None if row["id"] is None else StateRow(**row)


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
class DeadRow(_Listed):
    """A dead message as the console lists it: its last error (300 characters) and its
    payload's JSON (200) shortened; ``age`` in seconds since ``created_at``.

    :ivar payload: the stored JSON text of the payload its handler receives (a subscription's
        row: its owner's), cut to 200 characters.
    :ivar payload_json: that payload whole, as psycopg loads it, when its text is at most 2,000
        characters (``None`` otherwise): what a page decodes (:func:`outbox_celery.codec.decode`).
    """

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


@dataclass(frozen=True, slots=True)
class DeadPage:
    """The dead-letter page: how many dead messages match, the highest matching id (``None``
    when none: what a bulk action is then bounded by), and one page of them."""

    matching: int
    upto: int | None
    rows: list[DeadRow]


def dead_page(
    conn: psycopg.Connection[Any],
    table: str | TableName,
    query: DeadQuery,
    *,
    after: int = 0,
    limit: int = 50,
) -> DeadPage:
    """:func:`count_dead` and :func:`list_dead` in one read of the dead rows: a text filter
    reads each dead row's error or payload once."""
    params = {**query.params(), "after": after, "limit": limit}
    read = many(conn, _q(table, "console_dead_page"), params, _dead_page_row)
    matching, upto = read[0][0], read[0][1]
    return DeadPage(matching, upto, [r for _, _, r in read if r is not None])


def _dead_page_row(*, matching: int, upto: int | None, **row: Any) -> tuple[int, int | None, DeadRow | None]:
    """A row of ``console_dead_page``: the count, the highest id, and the row (``None``: an
    empty page)."""
    return int(matching), None if upto is None else int(upto), None if row["id"] is None else DeadRow(**row)


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
