"""Operator-side queries: stats, dead letters (list, show, requeue, skip) and retention.

What the ``outbox-celery`` CLI, the Prometheus collector and the retention beat task run. The
SQL lives in ``sql/admin.sql``; every function takes a psycopg connection and a table name.

Writes say how many rows they changed and refuse ambiguous or wrong input with
:class:`AdminError` before anything changes. Batched writes (:func:`purge_done`,
:func:`requeue_all`) run each batch in its own short transaction, so they need a connection
that is not inside a transaction already.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, TypedDict, Unpack

import psycopg
from psycopg import pq, sql
from psycopg.rows import dict_row

from .._seconds import seconds
from ..config import TableName
from ..db import statements as _sql
from ..errors import AdminError as AdminError
from ..message import KEY_SEPARATOR
from . import subscriptions
from .groups import (
    DeadMember,
    GroupInfo,
    GroupSummary,
    cancel_group,
    finish_group,
    get_group,
    group_outcomes,
    group_summary,
    list_groups,
    purge_groups,
)

__all__ = [
    "DEFAULT_STATS_CAP",
    "SKIPPED_BY_OPERATOR",
    "AdminError",
    "AttemptsBucket",
    "DeadFilters",
    "DeadMember",
    "DeadMessage",
    "EventTypeStats",
    "FlowState",
    "GroupInfo",
    "GroupSummary",
    "Horizon",
    "KeyFlowState",
    "Stats",
    "Unclaimed",
    "cancel_group",
    "count_dead",
    "count_purgeable",
    "finish_group",
    "flow_states",
    "flow_targets",
    "format_duration",
    "get_group",
    "get_message",
    "group_outcomes",
    "group_summary",
    "horizon",
    "key_states",
    "list_dead",
    "list_groups",
    "parse_duration",
    "pause",
    "prune_flow_keys",
    "purge_done",
    "repair_heads",
    "requeue",
    "requeue_all",
    "resume",
    "skip",
    "stats",
    "unclaimed",
    "was_skipped",
]

logger = logging.getLogger(__name__)

# last_error keeps what it had behind the operator's prefix; the SQL truncates to this much.
MAX_REASON_LENGTH = 1000
#: How a skipped message's ``last_error`` starts: the row is ``done`` (its state machine has no
#: other end), and this tells it from a delivered one.
SKIPPED_BY_OPERATOR = "skipped by operator"


def was_skipped(status: str, last_error: str | None) -> bool:
    """Whether a row is ``done`` because an operator skipped it (:func:`skip`), not delivered."""
    return status == "done" and (last_error or "").startswith(SKIPPED_BY_OPERATOR + ": ")


# -- durations ---------------------------------------------------------------------------------

_UNITS = {"w": 7 * 86400.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_DURATION = re.compile(r"(?:\d+(?:\.\d+)?[wdhms])+")
_PART = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number and a unit, or several (``7d``, ``12h``, ``1h30m``, ``1w``).

    Units: ``w`` weeks, ``d`` days, ``h`` hours, ``m`` minutes, ``s`` seconds. A bare number is
    refused (is ``7`` seconds or days?). Raises :class:`ValueError` with a one-line message.
    """
    value = text.strip().lower() if isinstance(text, str) else ""
    if not _DURATION.fullmatch(value):
        raise ValueError(
            f"malformed duration {text!r}: use a number and a unit (w, d, h, m, s), "
            "e.g. 7d, 12h, 30m, 45s, 1w"
        )
    seconds = sum(float(n) * _UNITS[unit] for n, unit in _PART.findall(value))
    if not math.isfinite(seconds):
        raise ValueError(f"duration {text!r} is too large")
    return seconds


def format_duration(seconds: float | None) -> str:
    """A short human form of ``seconds``: ``45s``, ``12m 5s``, ``5h``, ``3d 4h``; ``-`` for None."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    for size, unit, sub_size, sub_unit in ((86400, "d", 3600, "h"), (3600, "h", 60, "m"), (60, "m", 1, "s")):
        if s >= size:
            rest = s % size // sub_size
            return f"{s // size}{unit} {rest}{sub_unit}" if rest else f"{s // size}{unit}"
    return f"{s}s"


# -- queries -----------------------------------------------------------------------------------


@functools.cache
def _queries(table: TableName) -> dict[str, sql.Composed]:
    # The operator's queries, plus the worker's where an operator action must do exactly what
    # a worker does (settle_heads after a skip).
    return {**_sql.queries("queries.sql", table), **_sql.queries("admin.sql", table)}


def _regclass(conn: psycopg.Connection[Any], table: str | TableName) -> str:
    """The table's quoted name, resolved to its oid in SQL (the notify channel, its sequence)."""
    return TableName.parse(table).identifier().as_string(conn)


def _q(table: str | TableName, name: str) -> sql.Composed:
    return _queries(TableName.parse(table))[name]


def _outside_transaction(conn: psycopg.Connection[Any], what: str) -> None:
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        raise AdminError(
            f"{what} runs each batch in its own short transaction; "
            "pass a connection that is not inside a transaction"
        )


def _ids(ids: Sequence[int]) -> list[int]:
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 1:
            raise AdminError(f"invalid message id {i!r}")
        out.append(i)
    return sorted(set(out))


# -- stats -------------------------------------------------------------------------------------

#: Index entries each of :func:`stats`' reads takes at most (per status; done rows too).
DEFAULT_STATS_CAP = 10_000


@dataclass(frozen=True, slots=True)
class EventTypeStats:
    """Live (not done) messages of one event type.

    :ivar ready: pending messages claimable now (due, and in turn for ordered ones).
    :ivar oldest_pending_age: seconds since ``created_at`` of its oldest pending message.
    :ivar has_handler: whether the loaded app has a handler for it (``None``: not known).
    :ivar unstarted: pending or processing messages claimed since their last start without a
        worker starting them (their tasks were lost: a queue with no consumer, a flushed
        broker, tasks expired in a queue). A live lease's own claim does not count yet.
    :ivar unstarted_claims: the most such claims in a row of one of those messages.
    """

    event_type: str
    pending: int
    ready: int
    processing: int
    dead: int
    oldest_pending_age: float | None
    has_handler: bool | None = None
    unstarted: int = 0
    unstarted_claims: int = 0
    #: Paused by an operator (``outbox-celery pause``): claimed by nobody.
    paused: bool = False
    #: Seconds a RateLimited outcome still holds it back (``None``: not held).
    held_for: float | None = None


@dataclass(frozen=True, slots=True)
class AttemptsBucket:
    """How many live messages have spent exactly ``attempts`` handler runs, per status."""

    attempts: int
    pending: int
    processing: int
    dead: int


@dataclass(frozen=True, slots=True)
class Horizon:
    """What holds back the database's xmin horizon, and the outbox table's dead row versions.

    While a transaction, prepared transaction, replication slot or standby holds the horizon,
    VACUUM removes no dead row version anywhere in the database; the claim keeps its cost
    bounded regardless (DESIGN invariant 18), but the table grows until it is released.

    :ivar kind: ``transaction``, ``prepared transaction``, ``replication slot`` or
        ``standby feedback``; ``None`` when nothing visible holds a snapshot.
    :ivar name: its pid, gid or slot name.
    :ivar application: the session's ``application_name`` (a slot's plugin, a prepared
        transaction's owner).
    :ivar state: the session's state (``idle in transaction``, ``active``...).
    :ivar seconds: how long its transaction has been open (``None`` for slots and standbys).
    :ivar xid_age: how many transaction ids old the snapshot it holds is.
    :ivar dead_row_versions: the outbox table's dead row versions (PostgreSQL's statistics).
    :ivar live_row_versions: its live row versions.
    :ivar last_vacuum_age: seconds since its last vacuum or autovacuum (``None``: never).
    """

    kind: str | None
    name: str | None
    application: str | None
    state: str | None
    seconds: float | None
    xid_age: int | None
    dead_row_versions: int
    live_row_versions: int
    last_vacuum_age: float | None

    def holder(self) -> str:
        """The oldest holder in a phrase (``"none"`` when nothing holds it)."""
        if self.kind is None:
            return "none"
        what = f"{self.kind} {self.name}"
        if self.application:
            what += f" ({self.application})"
        if self.state:
            what += f", {self.state}"
        if self.seconds is not None:
            what += f", open {format_duration(self.seconds)}"
        return what


def horizon(conn: psycopg.Connection[Any], table: str | TableName = "outbox") -> Horizon:
    """What holds the xmin horizon back, and ``table``'s dead row versions (see :class:`Horizon`)."""
    t = TableName.parse(table)
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(_q(t, "horizon"), {"table": t.identifier().as_string(conn)}).fetchone()
    assert row is not None
    return Horizon(
        kind=row["kind"],
        name=row["name"],
        application=row["application"],
        state=row["state"],
        seconds=row["seconds"],
        xid_age=None if row["xid_age"] is None else int(row["xid_age"]),
        dead_row_versions=int(row["dead_row_versions"] or 0),
        live_row_versions=int(row["live_row_versions"] or 0),
        last_vacuum_age=row["last_vacuum_age"],
    )


@dataclass(frozen=True, slots=True)
class FlowState:
    """An event type the claims hold back (DESIGN invariant 23).

    :ivar paused: paused by an operator (:func:`pause`) until :func:`resume`.
    :ivar held_for: seconds a :class:`~outbox_celery.errors.RateLimited` outcome still holds it
        (``None``: not held).
    """

    event_type: str
    paused: bool
    held_for: float | None


def _flow_ready(conn: psycopg.Connection[Any], t: TableName) -> bool:
    name = t.identifier(_sql.FLOW_SUFFIX).as_string(conn)
    row = conn.execute(_q(t, "flow_exists"), {"flow_table": name}).fetchone()
    return bool(row and row[0])


def flow_states(conn: psycopg.Connection[Any], table: str | TableName = "outbox") -> list[FlowState]:
    """Event types paused or held by a RateLimited outcome (empty before migration 0007)."""
    t = TableName.parse(table)
    if not _flow_ready(conn, t):
        return []
    rows = conn.execute(_q(t, "flow_list")).fetchall()
    return [
        FlowState(str(r[0]), bool(r[1]), None if r[2] is None or r[2] <= 0 else float(r[2])) for r in rows
    ]


def _event_type(event_type: str) -> str:
    if not isinstance(event_type, str) or not event_type:
        raise AdminError(f"invalid event type {event_type!r}: expected a non-empty string")
    return event_type


@dataclass(frozen=True, slots=True)
class KeyFlowState:
    """A limit key the claims hold back (DESIGN invariant 24).

    :ivar paused: paused by an operator (:func:`pause` with ``limit_key``) until resumed.
    :ivar held_for: seconds a :class:`~outbox_celery.errors.RateLimited` outcome of one of its
        messages still holds it (``None``: not held).
    """

    event_type: str
    limit_key: str
    paused: bool
    held_for: float | None


def _flow_keys_ready(conn: psycopg.Connection[Any], t: TableName) -> bool:
    name = t.identifier(_sql.FLOW_KEY_SUFFIX).as_string(conn)
    row = conn.execute(_q(t, "flow_keys_exist"), {"flow_key_table": name}).fetchone()
    return bool(row and row[0])


def key_states(conn: psycopg.Connection[Any], table: str | TableName = "outbox") -> list[KeyFlowState]:
    """Limit keys paused or held by a RateLimited outcome (empty before migration 0008)."""
    t = TableName.parse(table)
    if not _flow_keys_ready(conn, t):
        return []
    rows = conn.execute(_q(t, "flow_key_list")).fetchall()
    return [
        KeyFlowState(str(r[0]), str(r[1]), bool(r[2]), None if r[3] is None or r[3] <= 0 else float(r[3]))
        for r in rows
    ]


def _limit_key(limit_key: str) -> str:
    if not isinstance(limit_key, str) or not limit_key:
        raise AdminError(f"invalid limit key {limit_key!r}: expected a non-empty string")
    return limit_key


def pause(
    conn: psycopg.Connection[Any], table: str | TableName, event_type: str, *, limit_key: str | None = None
) -> bool:
    """Pause ``event_type`` (docs/flow-control.md, DESIGN invariant 23), or only its
    ``limit_key`` (DESIGN invariant 24: the type's other keys flow on).

    From the next claim on (every claim reads the pause under its row's lock) no claim hands out
    its messages, on any worker; deliveries already running finish. An event type with no
    message yet can be paused too. An event type with subscriptions (DESIGN invariant 28) is
    paused with every route of it (:func:`flow_targets`), in one transaction; a route
    (``order.paid@receipt``) alone pauses that subscription. Returns whether it was running
    (``False``: paused already, every route of it too).
    """
    t = TableName.parse(table)
    with conn.transaction():
        running = False
        for target in flow_targets(conn, t, event_type):
            if limit_key is not None:
                params = {"event_type": target, "limit_key": _limit_key(limit_key)}
                row = conn.execute(_q(t, "flow_key_pause"), params).fetchone()
            else:
                row = conn.execute(_q(t, "flow_pause"), {"event_type": target}).fetchone()
            running |= not bool(row and row[0])
    return running


def resume(
    conn: psycopg.Connection[Any], table: str | TableName, event_type: str, *, limit_key: str | None = None
) -> bool:
    """Resume ``event_type`` (or only its ``limit_key``): its pause and any RateLimited hold on
    it end, and the table's push listeners are woken at commit, so its messages are claimed at
    once. An event type with subscriptions is resumed with every route of it, as :func:`pause`
    paused them. Returns whether it (or any route of it) was paused or held.
    """
    t = TableName.parse(table)
    with conn.transaction():
        held = False
        for target in flow_targets(conn, t, event_type):
            params: dict[str, Any] = {"event_type": target, "table": t.identifier().as_string(conn)}
            if limit_key is not None:
                params["limit_key"] = _limit_key(limit_key)
                row = conn.execute(_q(t, "flow_key_resume"), params).fetchone()
            else:
                row = conn.execute(_q(t, "flow_resume"), params).fetchone()
            held |= bool(row and row[0])
    return held


def flow_targets(conn: psycopg.Connection[Any], table: str | TableName, event_type: str) -> list[str]:
    """What pausing or resuming ``event_type`` reaches: the type, then the routes of its
    subscriptions (removed ones too: a worker with the handler still claims their rows); a
    route (``order.paid@receipt``) or a type without subscriptions is itself alone (DESIGN
    invariants 23 and 28)."""
    return [_event_type(event_type), *subscriptions.routes(conn, table, event_type)]


@dataclass(frozen=True, slots=True)
class Stats:
    """A snapshot of one outbox table (one statement, so the figures agree with each other).

    :ivar counts: rows per status (``pending``, ``processing``, ``done``, ``dead``).
    :ivar ready: pending rows claimable now: ``available_at`` has come and, for ordered rows,
        the row is the head of its key.
    :ivar scheduled: pending rows whose ``available_at`` is still ahead (a delay, a backoff, a
        defer). Pending rows neither ready nor scheduled wait behind the head of their key.
    :ivar oldest_pending_age: seconds since ``created_at`` of the oldest pending row
        (end-to-end latency, including intended delays); ``None`` when nothing is pending.
    :ivar oldest_ready_wait: seconds the oldest claimable row has waited past its
        ``available_at`` without being claimed (the claim's lag); ``None`` when none.
    :ivar oldest_processing_age: seconds since ``created_at`` of the oldest processing row.
    :ivar expired_leases: processing rows whose lease ran out (worker lost or stuck; the next
        claim takes them back, or reaps them to dead when out of attempts).
    :ivar blocked_keys: ordering keys whose head (lowest unfinished id) is dead.
    :ivar blocked_messages: messages waiting behind those dead heads.
    :ivar headless_keys: ordering keys with unfinished messages none of which is the head, so
        none is ever claimed (left by a producer or worker of a release before migration 0004);
        :func:`repair_heads` (``outbox-celery repair-heads``) mends them. Should be 0.
    :ivar attempts: the attempts histogram of live rows.
    :ivar event_types: live rows per event type.
    :ivar unroutable: pending event types with no handler (only when handlers were given).
    :ivar unstarted: messages whose latest claims' tasks never started, all event types (see
        :attr:`EventTypeStats.unstarted`).
    :ivar horizon: what holds back the xmin horizon and the table's dead row versions.
    :ivar cap: the most index entries each of the bounded reads took (``None``: no cap, every
        unfinished row read; see :func:`stats`).
    :ivar capped: per status of :attr:`counts`, whether its read stopped at the cap: its count
        (and the figures derived from those rows: ready, scheduled, ages, the attempts
        histogram, event types) is then a lower bound. For ``done``, past the cap the count is
        an estimate from PostgreSQL's statistics, not a count.
    :ivar done_last_minute: rows that became done in the last minute (the database clock),
        read from the newest end of ``done_idx``; a lower bound when ``capped["done"]``.
    """

    table: str
    now: datetime
    counts: dict[str, int]
    ready: int
    scheduled: int
    oldest_pending_age: float | None
    oldest_ready_wait: float | None
    oldest_processing_age: float | None
    expired_leases: int
    blocked_keys: int
    blocked_messages: int
    attempts: list[AttemptsBucket]
    event_types: list[EventTypeStats]
    unroutable: list[str] | None = field(default=None)
    unstarted: int = 0
    horizon: Horizon | None = None
    headless_keys: int = 0
    #: Event types paused or held by a RateLimited outcome, whether or not they have live
    #: messages; empty before migration 0007.
    flow: list[FlowState] = field(default_factory=list)
    #: Limit keys paused or held by a RateLimited outcome (DESIGN invariant 24); empty before
    #: migration 0008.
    keys: list[KeyFlowState] = field(default_factory=list)
    cap: int | None = DEFAULT_STATS_CAP
    capped: dict[str, bool] = field(default_factory=dict)
    done_last_minute: int = 0
    #: Open groups with a callback (DESIGN invariant 29); empty before migration 0012.
    groups: GroupSummary = field(default_factory=GroupSummary)

    @property
    def dead(self) -> int:
        """Rows in ``dead`` (waiting for a human)."""
        return self.counts["dead"]

    def shown(self, status: str) -> str:
        """A status' count as read, for people: ``N+`` when its read stopped at the cap (a lower
        bound), ``~N`` for a done count estimated from the table's statistics."""
        n = self.counts[status]
        if not self.capped.get(status):
            return str(n)
        return f"~{n}" if status == "done" else f"{n}+"

    @property
    def shown_counts(self) -> dict[str, str]:
        """:meth:`shown` of every status (what the Django admin's summary prints)."""
        return {status: self.shown(status) for status in self.counts}

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form (``now`` as ISO 8601)."""
        d = asdict(self)
        d["now"] = self.now.isoformat()
        return d


def stats(
    conn: psycopg.Connection[Any],
    table: str | TableName = "outbox",
    *,
    handlers: Collection[str] | None = None,
    timeout: float | None = None,
    cap: int | None = DEFAULT_STATS_CAP,
) -> Stats:
    """Take a :class:`Stats` snapshot of ``table``: bounded reads, whatever the table holds.

    Each status is read from its partial index, at most ``cap`` entries (pending unordered,
    ordered, processing, dead), and done rows only from the newest end of ``done_idx``, at most
    ``cap``: the cost does not grow with the done history or the backlog. A status whose read
    reached the cap is flagged in :attr:`Stats.capped` and its count is a lower bound; the done
    count past the cap is an estimate (table statistics). ``cap=None`` reads every row of each
    status, ``done_idx`` whole included, for exact counts: the cost then grows with the table.

    :param handlers: event types that have a handler; when given, pending event types missing
        from it are reported in :attr:`Stats.unroutable`.
    :param timeout: a statement timeout in seconds (the Prometheus collector sets one so a
        slow database never hangs a scrape).
    :param cap: index entries each read takes at most (default :data:`DEFAULT_STATS_CAP`);
        ``None`` for exact counts at the cost of reading every row.
    """
    if cap is not None and cap < 1:
        raise AdminError("cap must be at least 1 (or None for exact counts)")
    t = TableName.parse(table)
    with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
        previous = None
        if timeout is not None:
            # Local to the transaction, and a savepoint (a caller's transaction: Django's
            # changelist under ATOMIC_REQUESTS) does not undo it: the caller's own value comes
            # back after the query. A failed query rolls the savepoint, and it, back.
            previous = cur.execute(
                "SELECT current_setting('statement_timeout') AS previous,"
                " set_config('statement_timeout', %s, true)",
                [f"{int(timeout * 1000)}ms"],
            ).fetchone()
        row = cur.execute(_q(t, "stats"), {"cap": cap, "table": t.identifier().as_string(conn)}).fetchone()
        held = horizon(conn, t)
        flow = flow_states(conn, t)
        keys = key_states(conn, t)
        groups = group_summary(conn, t, cap=cap)
        if previous is not None:
            cur.execute("SELECT set_config('statement_timeout', %s, true)", [previous["previous"]])
    assert row is not None
    known = set(handlers) if handlers is not None else None
    types = _event_types(row["event_types"], known, flow)
    unroutable = None
    if known is not None:
        unroutable = [e.event_type for e in types if e.pending and not e.has_handler]
    return Stats(
        table=t.qualified,
        now=row["now"],
        counts={s: int(row[s]) for s in ("pending", "processing", "done", "dead")},
        ready=int(row["ready"]),
        scheduled=int(row["scheduled"]),
        oldest_pending_age=row["oldest_pending_age"],
        oldest_ready_wait=row["oldest_ready_wait"],
        oldest_processing_age=row["oldest_processing_age"],
        expired_leases=int(row["expired_leases"]),
        blocked_keys=int(row["blocked_keys"]),
        blocked_messages=int(row["blocked_messages"]),
        attempts=[AttemptsBucket(**{k: int(v) for k, v in a.items()}) for a in row["attempts"]],
        event_types=types,
        unroutable=unroutable,
        unstarted=int(row["unstarted"]),
        horizon=held,
        headless_keys=int(row["headless_keys"]),
        flow=flow,
        keys=keys,
        cap=cap,
        capped={s: bool(row[f"{s}_capped"]) for s in ("pending", "processing", "done", "dead")},
        done_last_minute=int(row["done_last_minute"]),
        groups=groups,
    )


def _event_types(
    rows: Sequence[dict[str, Any]], known: set[str] | None, flow: Sequence[FlowState]
) -> list[EventTypeStats]:
    """The per-type lines of :func:`stats`: counts, whether a handler is known, pause and hold."""
    by_type = {f.event_type: f for f in flow}
    return [
        EventTypeStats(
            event_type=e["event_type"],
            pending=int(e["pending"]),
            ready=int(e["ready"]),
            processing=int(e["processing"]),
            dead=int(e["dead"]),
            oldest_pending_age=e["oldest_pending_age"],
            has_handler=None if known is None else e["event_type"] in known,
            unstarted=int(e["unstarted"]),
            unstarted_claims=int(e["unstarted_claims"]),
            paused=e["event_type"] in by_type and by_type[e["event_type"]].paused,
            held_for=by_type[e["event_type"]].held_for if e["event_type"] in by_type else None,
        )
        for e in rows
    ]


@dataclass(frozen=True, slots=True)
class Unclaimed:
    """Claimable messages of one event type that no claim has taken for too long.

    :ivar messages: how many have waited past the threshold since they became claimable (a lower
        bound past the read's cap, see :func:`unclaimed`).
    :ivar oldest_wait: seconds the oldest of them has waited since its ``available_at``.
    """

    event_type: str
    messages: int
    oldest_wait: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return asdict(self)


def unclaimed(
    conn: psycopg.Connection[Any],
    table: str | TableName = "outbox",
    *,
    older_than: float,
    cap: int | None = DEFAULT_STATS_CAP,
) -> list[Unclaimed]:
    """Per event type, the claimable messages left unclaimed more than ``older_than`` seconds.

    A running outbox claims a due message within one ``claim_interval`` (at once with push), so
    a message left several intervals is not being claimed: no claim worker is running (or beat
    and push both stopped), no claiming app has a handler for its event type, or the in-flight
    bound has been full all that time. Ordered messages count only as the head of their key.
    Each pending index is read at most ``cap`` entries (``None``: no cap), the oldest first:
    past the cap ``messages`` is a lower bound; ``oldest_wait`` stays exact.
    """
    older_than = seconds(older_than, "older_than", error=AdminError)
    if cap is not None and cap < 1:
        raise AdminError("cap must be at least 1 (or None)")
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(_q(table, "unclaimed"), {"older_than": older_than, "cap": cap}).fetchall()
    return [Unclaimed(r["event_type"], int(r["messages"]), float(r["oldest_wait"])) for r in rows]


# -- dead letters ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeadMessage:
    """One row of :func:`list_dead`.

    :ivar age: seconds since ``created_at``.
    :ivar waiting_behind: messages of its ordering key after it that are not done (what it
        blocks if it is the head); 0 for unordered messages.
    """

    id: int
    event_type: str
    aggregate_type: str
    aggregate_id: str
    ordering_key: str | None
    attempts: int
    created_at: datetime
    age: float
    last_error: str | None
    waiting_behind: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        d = asdict(self)
        d["created_at"] = self.created_at.isoformat()
        return d


class DeadFilters(TypedDict, total=False):
    """Which dead messages :func:`list_dead` and :func:`count_dead` take; absent or ``None``
    matches every one. ``older_than``/``newer_than`` are seconds since ``created_at``."""

    event_type: str | None
    aggregate_type: str | None
    aggregate_id: str | None
    older_than: float | None
    newer_than: float | None


def _dead_params(filters: DeadFilters) -> dict[str, Any]:
    """Every filter as a query parameter (``None`` where absent); unknown names raise."""
    unknown = set(filters) - set(DeadFilters.__annotations__)
    if unknown:
        raise TypeError(f"unknown dead-letter filter(s): {', '.join(sorted(unknown))}")
    return {name: filters.get(name) for name in DeadFilters.__annotations__}


def list_dead(
    conn: psycopg.Connection[Any],
    table: str | TableName = "outbox",
    *,
    after: int = 0,
    limit: int = 50,
    **filters: Unpack[DeadFilters],
) -> list[DeadMessage]:
    """Dead messages by id, filtered; page with ``after`` = the last id of the previous page.

    ``filters``: :class:`DeadFilters` (``event_type=``, ``older_than=`` ...).
    """
    if limit < 1:
        raise AdminError("limit must be at least 1")
    params = _dead_params(filters)
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(_q(table, "dead_list"), {**params, "after": after, "limit": limit}).fetchall()
    return [
        DeadMessage(**{**r, "id": int(r["id"]), "waiting_behind": int(r["waiting_behind"])}) for r in rows
    ]


def count_dead(
    conn: psycopg.Connection[Any],
    table: str | TableName = "outbox",
    **filters: Unpack[DeadFilters],
) -> int:
    """How many dead messages match the filters of :func:`list_dead`."""
    row = conn.execute(_q(table, "dead_count"), _dead_params(filters)).fetchone()
    return int(row[0]) if row else 0


def get_message(
    conn: psycopg.Connection[Any], table: str | TableName, outbox_id: int
) -> dict[str, Any] | None:
    """Every column of one message (any status) plus what explains its state, or ``None``.

    Extra keys: ``now``, ``age`` (seconds since created), ``available_in`` and
    ``lease_expires_in`` (seconds from now, negative when past), ``key_head`` (the id of its
    ordering key's head, the unfinished message flagged ``head``; ``None`` when it has none) and
    ``waiting_behind`` (unfinished messages after it in its key).
    """
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(_q(table, "show"), {"id": outbox_id}).fetchone()
    if row is not None:
        row["waiting_behind"] = int(row["waiting_behind"])
    return row


def _check_statuses(
    conn: psycopg.Connection[Any], table: str | TableName, ids: list[int], allowed: tuple[str, ...], verb: str
) -> None:
    """Lock ``ids`` and refuse (raise) unless every one exists with an allowed status.

    A ``processing`` row whose lease has expired is allowed too: no worker holds it (its task
    was lost, or its event type has no handler any more). A live lease is refused.
    """
    rows = conn.execute(_q(table, "lock_ids"), {"ids": ids}).fetchall()
    found = {int(r[0]): str(r[1]) for r in rows}
    lease_in = {int(r[0]): r[2] for r in rows}
    missing = [i for i in ids if i not in found]
    if missing:
        raise AdminError(f"no message with id {', '.join(map(str, missing))} in {TableName.parse(table)}")
    live = [i for i in ids if found[i] == "processing" and (lease_in[i] is None or lease_in[i] > 0)]
    if live:
        raise AdminError(
            f"cannot {verb}: message {', '.join(map(str, live))} is processing under a live lease "
            f"(ends in {format_duration(math.ceil(max(lease_in[i] or 0.0 for i in live)))}; "
            "a worker may be running it): "
            "try again once the lease has expired"
        )
    wrong = [f"{i} is {found[i]}" for i in ids if found[i] not in (*allowed, "processing")]
    if wrong:
        past = {"requeue": "requeued", "skip": "skipped"}.get(verb, verb)
        raise AdminError(
            f"cannot {verb}: message {'; '.join(wrong)} (only {' or '.join(allowed)} messages, "
            f"or processing ones whose lease expired, can be {past})"
        )


def _reason(reason: str | None, *, required: bool) -> str | None:
    if reason is None or not reason.strip():
        if required:
            raise AdminError("a reason is required")
        return None
    if "\x00" in reason:
        raise AdminError("the reason must not contain NUL characters")
    return reason.strip()[:MAX_REASON_LENGTH]


def requeue(
    conn: psycopg.Connection[Any],
    table: str | TableName,
    ids: Sequence[int],
    *,
    reason: str | None = None,
) -> list[int]:
    """Dead -> pending now, attempts reset, the previous error kept behind a prefix.

    A ``processing`` message whose lease has expired is requeued the same way (its task was
    lost, or its event type lost its handler); one under a live lease is refused.
    All or nothing: if any id is unknown or not dead, :class:`AdminError` is raised and nothing
    changes. Returns the requeued ids.
    """
    wanted = _ids(ids)
    if not wanted:
        raise AdminError("no message ids given")
    why = _reason(reason, required=False)
    with conn.transaction():
        _check_statuses(conn, table, wanted, ("dead",), "requeue")
        params = {"ids": wanted, "reason": why, "table": _regclass(conn, table)}
        rows = conn.execute(_q(table, "requeue_ids"), params).fetchall()
    done = sorted(int(r[0]) for r in rows)
    logger.warning(
        "operator requeued %s dead message(s)",
        len(done),
        extra={"outcome": "requeued", "outbox_ids": done, "outbox_table": str(TableName.parse(table))},
    )
    return done


def requeue_all(
    conn: psycopg.Connection[Any],
    table: str | TableName = "outbox",
    *,
    event_type: str | None = None,
    reason: str | None = None,
    batch_size: int = 1000,
) -> int:
    """Requeue every dead message (of ``event_type``), in batches; returns how many.

    Each batch is its own short transaction; the loop moves forward by id, so a message that
    dies again while it runs is not requeued twice.
    """
    _outside_transaction(conn, "requeue --all")
    if batch_size < 1:
        raise AdminError("batch_size must be at least 1")
    why = _reason(reason, required=False)
    total, after = 0, 0
    while True:
        with conn.transaction():
            rows = conn.execute(
                _q(table, "requeue_batch"),
                {
                    "after": after,
                    "event_type": event_type,
                    "reason": why,
                    "limit": batch_size,
                    "table": _regclass(conn, table),
                },
            ).fetchall()
        total += len(rows)
        if len(rows) < batch_size:
            break
        after = max(int(r[0]) for r in rows)
    logger.warning(
        "operator requeued %s dead message(s)",
        total,
        extra={"outcome": "requeued", "event_type": event_type, "outbox_table": str(TableName.parse(table))},
    )
    return total


def skip(
    conn: psycopg.Connection[Any],
    table: str | TableName,
    ids: Sequence[int],
    *,
    reason: str,
) -> list[int]:
    """Mark dead (or pending) messages done without delivering them, recording ``reason``.

    Used to unblock an ordered key whose head can never be delivered. A ``processing`` message
    is skipped only once its lease has expired (no worker holds it any more); under a live lease
    it is refused. All or nothing, like :func:`requeue`.
    """
    wanted = _ids(ids)
    if not wanted:
        raise AdminError("no message ids given")
    why = _reason(reason, required=True)
    with conn.transaction():
        # Key locks before row locks, as producers and the ordered done take them (invariant 9).
        regclass = TableName.parse(table).identifier().as_string(conn)
        conn.execute(_q(table, "lock_keys_of_ids"), {"table": regclass, "ids": wanted})
        _check_statuses(conn, table, wanted, ("dead", "pending"), "skip")
        params = {"ids": wanted, "reason": why, "skip_mark": SKIPPED_BY_OPERATOR, "table": regclass}
        rows = conn.execute(_q(table, "skip_ids"), params).fetchall()
        keys = sorted({str(r[1]) for r in rows if r[1] is not None})
        if keys:
            # Its own statement: it sees the skip and every message of the keys committed so far.
            conn.execute(_q(table, "settle_heads"), {"keys": keys})
    done = sorted(int(r[0]) for r in rows)
    logger.warning(
        "operator skipped %s message(s): %s",
        len(done),
        why,
        extra={"outcome": "skipped", "outbox_ids": done, "outbox_table": str(TableName.parse(table))},
    )
    return done


def repair_heads(
    conn: psycopg.Connection[Any], table: str | TableName, *, batch_size: int = 500
) -> list[str]:
    """Give every ordering key without a head its head back; return the keys mended.

    A key whose unfinished messages carry no ``head`` flag is never claimed: a producer
    or worker of a release before migration 0004, still running after it, leaves such keys.
    Each batch of at most ``batch_size`` keys is its own transaction that takes the keys'
    producer locks (sorted, as producers do) and flags the lowest unfinished message of each key
    still without a head (DESIGN invariant 9), so it is safe while producers and workers run.
    ``conn`` must not be inside a transaction. Idempotent: a second run mends nothing.
    """
    _outside_transaction(conn, "repair_heads")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise AdminError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    t = TableName.parse(table)
    regclass = t.identifier().as_string(conn)
    mended: list[str] = []
    after = ""
    while True:
        keys = [
            str(r[0]) for r in conn.execute(_q(t, "headless_keys"), {"after": after, "limit": batch_size})
        ]
        if not keys:
            break
        with conn.transaction():
            # A subscription's stored key takes its producer's key lock (DESIGN invariant 28).
            locks = [k.partition(KEY_SEPARATOR)[0] for k in keys]
            conn.execute(_q(t, "lock_keys"), {"table": regclass, "keys": locks})
            mended += sorted(str(r[1]) for r in conn.execute(_q(t, "settle_heads"), {"keys": keys}))
        if len(keys) < batch_size:
            break
        after = keys[-1]
    if mended:
        logger.warning(
            "outbox repair: %s ordering key(s) had no head; their lowest unfinished message is "
            "the head again",
            len(mended),
            extra={"outcome": "heads_repaired", "keys": len(mended), "outbox_table": str(t)},
        )
    return mended


# -- retention ---------------------------------------------------------------------------------


def _cutoff(conn: psycopg.Connection[Any], table: str | TableName, older_than: float) -> datetime:
    older_than = seconds(older_than, "older_than", error=AdminError)
    row = conn.execute(_q(table, "purge_cutoff"), {"older_than": older_than}).fetchone()
    assert row is not None
    cutoff: datetime = row[0]
    return cutoff


def count_purgeable(conn: psycopg.Connection[Any], table: str | TableName, *, older_than: float) -> int:
    """How many ``done`` rows finished more than ``older_than`` seconds ago (a dry run)."""
    cutoff = _cutoff(conn, table, older_than)
    row = conn.execute(_q(table, "purge_count"), {"cutoff": cutoff}).fetchone()
    return int(row[0]) if row else 0


def prune_flow_keys(
    conn: psycopg.Connection[Any],
    table: str | TableName = "outbox",
    *,
    batch_size: int = 5000,
    max_batches: int | None = None,
) -> int:
    """Delete the per-key flow state that is worth nothing any more; return rows deleted.

    A row of ``<table>_flow_key`` whose key is neither paused nor held, whose ``key_rate``
    bucket is full again (or that never had one) and that nothing touched for a minute says
    nothing an absent row does not (DESIGN invariant 25): the table stays the size of the keys
    paused, held or recently rate limited, not of every key ever seen. :func:`purge_done` (the
    retention task, ``outbox-celery purge``) runs it. Batches of ``batch_size``, each its own
    short transaction, so ``conn`` must not be inside a transaction. Nothing before migration
    0009.
    """
    _outside_transaction(conn, "prune")
    t = TableName.parse(table)
    if not _flow_keys_ready(conn, t) or not _flow_key_prunable(conn, t):
        return 0
    query = _q(t, "flow_keys_prune")
    total = batches = 0
    while max_batches is None or batches < max_batches:
        with conn.transaction():
            n = conn.execute(query, {"limit": batch_size}).rowcount
        total += n
        batches += 1
        if n < batch_size:
            break
    return total


def _flow_key_prunable(conn: psycopg.Connection[Any], t: TableName) -> bool:
    """Whether migration 0009 (the buckets' ``full_at``) is applied."""
    name = t.identifier(_sql.FLOW_KEY_SUFFIX).as_string(conn)
    row = conn.execute(_q(t, "flow_key_full_at_exists"), {"flow_key_table": name}).fetchone()
    return bool(row and row[0])


def purge_done(
    conn: psycopg.Connection[Any],
    table: str | TableName,
    *,
    older_than: float,
    batch_size: int,
    max_batches: int | None = None,
) -> int:
    """Delete ``done`` rows older than ``older_than`` seconds in batches; return rows deleted.

    Only ``done`` rows whose ``done_at`` is before ``now() - older_than`` (fixed when the run
    starts) are deleted; pending, processing and dead rows are never touched. Each batch of at
    most ``batch_size`` rows is its own short transaction (``FOR UPDATE SKIP LOCKED``, so two
    purges never wait on each other), hence ``conn`` must not be inside a transaction.
    ``max_batches`` bounds the run; the next run continues. Then the per-key flow state
    worth nothing any more goes too (:func:`prune_flow_keys`), and the groups closed before the
    cutoff (:func:`~outbox_celery.ops.groups.purge_groups`), neither counted in the result.
    """
    _outside_transaction(conn, "purge")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise AdminError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    cutoff = _cutoff(conn, table, older_than)
    query = _q(table, "purge_batch")
    total = batches = 0
    while max_batches is None or batches < max_batches:
        with conn.transaction():
            n = conn.execute(query, {"cutoff": cutoff, "limit": batch_size}).rowcount
        total += n
        batches += 1
        if n < batch_size:
            break
    prune_flow_keys(conn, table, batch_size=batch_size, max_batches=max_batches)
    purge_groups(conn, table, cutoff=cutoff, batch_size=batch_size, max_batches=max_batches)
    if total:
        logger.info(
            "outbox purge: deleted %s done row(s) older than %s in %s batch(es)",
            total,
            format_duration(older_than),
            batches,
            extra={
                "outcome": "purged",
                "deleted": total,
                "batches": batches,
                "outbox_table": str(TableName.parse(table)),
            },
        )
    return total
