"""The stats snapshot of an outbox table: what ``outbox-celery stats``, the Prometheus collector
and the Django admin's summary show, and the claimable messages no claim takes (``unclaimed``).

Every read is bounded: each status is read from its partial index up to a cap, done rows only
from the newest end of theirs, so a snapshot costs the same whatever the done history holds.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ..errors import AdminError, seconds
from ..table import TableName
from ._queries import many, q, regclass
from .durations import CLAIM_OVERDUE_MARGIN as CLAIM_OVERDUE_MARGIN
from .durations import overdue_after as overdue_after
from .flow import FlowState, KeyFlowState, flow_states, key_states
from .groups import GroupSummary, group_summary
from .horizon import Horizon, horizon

__all__ = [
    "CLAIM_OVERDUE_MARGIN",
    "DEFAULT_STATS_CAP",
    "AttemptsBucket",
    "EventTypeStats",
    "Stats",
    "Unclaimed",
    "overdue_after",
    "stats",
    "unclaimed",
]

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
        :func:`~outbox_celery.ops.heads.repair_heads` (``outbox-celery repair-heads``) mends them.
        Should be 0.
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
        row = cur.execute(q(t, "stats"), {"cap": cap, "table": regclass(conn, t)}).fetchone()
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
    params = {"older_than": older_than, "cap": cap}
    return many(conn, q(table, "unclaimed"), params, _unclaimed)


def _unclaimed(*, event_type: str, messages: int, oldest_wait: float) -> Unclaimed:
    return Unclaimed(event_type, int(messages), float(oldest_wait))
