"""The claim's executor: one claim transaction, run step by step as the planner decides.

One claim (:func:`claim`, on a :class:`~outbox_celery.db.store.Store`'s statements)::

    settings + now()           claim_settings_flow: held types, held keys, a claim run's
      |                          claim lock (no row lock); the probes of the expired
      |                          and heads ranges (claim_probes)
    room                         a claim run's in-flight count, after its claim lock
      |
    plan_flow -----------------> flow_add, flow_lock, flow_keys_clear, flow_live
      |                          (none when no limit is declared and nothing is held)
    flow_read, keyed_walks       allowances, key walks          [claim_plan: pure]
      |
    fill_asks -----------------> fill_due -> filling            (batch max_wait)
      |
    maintenance                  first_expired (probed already unless the marks moved);
                                 release_expired, reap, release_keyed_expired
                                 (none when no lease ran out since the expired mark)
      |
    expired_asks --------------> claim_expired_limited, claim_expired
      |
    fresh_rooms ---------------> claim_keyed, claim_heads/pending(_limited)
                                 (claim_heads not when the probe found no head due)
    more_rooms ----------------> the limited types' second round
      |
    flow_writes, flow_wait ----> flow_key_cursor, flow_spend, flow_at_cap; ClaimResult

The planner (:mod:`outbox_celery.claim.plan`) decides; the functions here run the statements
it names and read their rows into one typed row per query. The maintenance step (lost and
unroutable leases back to pending, exhausted ones dead) is its own step, run by every claim
before it claims (DESIGN invariants 5, 10, 16).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, NamedTuple, Protocol, TypeVar

import psycopg

from ..db import rows as _rows
from ..db.completer import Lease
from ..flow import Limit
from ..table import TableName
from . import plan
from .expired import FirstExpiredRow, Maintenance, ReapedRow, ReleasedRow, log_reaped, log_released
from .fan_out import BATCH as FAN_OUT_BATCH
from .fan_out import fan_out_bare
from .marks import ScanMarks
from .plan import FillRow, FlowRead, FlowRow, KeyedRow, KeyWalk, Seen

__all__ = ["ClaimParams", "ClaimResult", "Claimed", "FlowRead", "Maintenance", "ScanMarks", "claim"]

logger = logging.getLogger(__name__)

#: Expired leases handled per statement of a claim (release_expired, reap).
EXPIRED_BATCH = 1000

_R = TypeVar("_R")


class Room(Protocol):
    """A claim run's limit and held routes, counted in its claim transaction after the lock."""

    def __call__(self, conn: psycopg.Connection[Any], /) -> tuple[int, Collection[str]]: ...


class Store(Protocol):
    """What the executor uses of :class:`~outbox_celery.db.store.Store` (which passes itself)."""

    table: TableName
    _flow_warned: bool
    on: str
    log_fields: dict[str, str]

    @property
    def _q(self) -> Mapping[str, Any]:
        """The named queries, bound to the store's table."""

    def flow_ready(self, conn: psycopg.Connection[Any]) -> bool: ...

    def subscriptions_ready(self, conn: psycopg.Connection[Any]) -> bool: ...

    def _count(self, key: str, n: int = 1) -> None: ...

    #: The table's name, quoted, for the statements that resolve it to its oid in SQL.
    quoted: str


@dataclass(frozen=True, slots=True)
class Claimed:
    """A row handed out by a claim: what the delivery task needs to carry."""

    id: int
    lease_version: int
    event_type: str
    lease_until: datetime
    #: Attempts the row had spent when claimed: a row that spent one travels alone (invariant 30).
    attempts: int = 0

    @property
    def lease(self) -> Lease:
        """The claim's lease: what its fenced start and finalize are fenced on."""
        return Lease(self.id, self.lease_version)


# -- one row type per query result ----------------------------------------------------------------


class ClaimedRow(NamedTuple):
    """A row of a claiming statement (the ``claim_picked`` tail)."""

    id: int
    lease_version: int
    event_type: str
    lease_until: datetime
    available_at: datetime
    attempts: int

    def claimed(self) -> Claimed:
        """What the delivery task carries."""
        return Claimed(self.id, self.lease_version, self.event_type, self.lease_until, self.attempts)


class LiveRow(NamedTuple):
    """Live deliveries of one limited type (``flow_live``)."""

    event_type: str
    live: int


class SettingsRow(NamedTuple):
    """``claim_settings`` and ``claim_settings_flow``."""

    jit: str | None
    now: datetime | None
    #: Whether this transaction holds the table's claim lock; None: it was not asked for.
    locked: bool | None = None
    known: Sequence[str] = ()
    held: Sequence[str] = ()
    held_for: float | None = None
    key_types: Sequence[str] = ()
    key_held_for: float | None = None
    #: ``first_expired``'s answer, from the marks the claim expected (``claim_probes``).
    first_expired: datetime | None = None
    #: A pending head is due; None: not probed (a statement replaced without the probes).
    heads_due: bool | None = None

    def seen(self) -> Seen:
        """The planner's view of it."""
        return Seen(
            now=self.now,
            known=frozenset(self.known),
            held=frozenset(self.held),
            held_for=self.held_for,
            key_types=tuple(self.key_types),
            key_held_for=self.key_held_for,
        )


@dataclass(frozen=True, slots=True)
class Probes:
    """What a claim's first statement read ahead (``claim_probes``), from which scan bounds."""

    expired_since: datetime | None
    heads_since: datetime | None
    #: The earliest lease that ran out from ``expired_since``; None: none did.
    first_expired: datetime | None
    #: A pending head of the claimer's types is due from ``heads_since``.
    heads_due: bool


# -- results -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """What one claim transaction did."""

    claimed: list[Claimed]
    reaped: int
    #: Expired claims whose task never started, given back to pending with a growing delay.
    lost: int = 0
    #: Expired leases of event types the claimer has no handler for, given back as unroutable.
    unroutable: int = 0
    #: Seconds until a claim can take more of an event type a limit or a RateLimited hold kept
    #: back; ``None`` when none was kept back. The push listener claims again then.
    flow_wait: float | None = None
    #: Event types this claim left out: paused, or held by a RateLimited outcome.
    held: tuple[str, ...] = ()
    #: Batch handlers' event types whose due rows this claim left to fill a batch (``max_wait``,
    #: DESIGN invariant 21); ``flow_wait`` is then at most when the oldest of them has waited
    #: ``max_wait``.
    filling: tuple[str, ...] = ()
    #: False: the claim asked for the table's claim lock and another transaction held it; the
    #: claim did nothing.
    locked: bool = True
    #: The most new rows the claim asked for: its ``limit``, or what its ``room`` returned.
    limit: int = 0


@dataclass(frozen=True, slots=True)
class ClaimParams:
    """The parameters every statement of one claim shares."""

    lease: float
    owner: str
    max_attempts: int
    event_types: list[str] | None
    #: Types no general statement takes: held, limited (claimed by their own statements).
    excluded: list[str] = field(default_factory=list)
    #: Types claimed key by key (their keyed rows stay out of their own statements).
    keyed: list[str] = field(default_factory=list)
    pending_since: datetime | None = None
    heads_since: datetime | None = None
    expired_since: datetime | None = None
    #: ``excluded`` and the batch handlers' types left to fill (the pending statement only).
    excluded_pending: list[str] | None = None

    def sql(self, **more: Any) -> dict[str, Any]:
        """The named parameters of a statement: these and ``more``."""
        return {
            "lease": self.lease,
            "owner": self.owner,
            "max_attempts": self.max_attempts,
            "event_types": self.event_types,
            "excluded": self.excluded,
            "keyed": self.keyed,
            "pending_since": self.pending_since,
            "heads_since": self.heads_since,
            "expired_since": self.expired_since,
            **more,
        }


# -- the executor ----------------------------------------------------------------------------------


class _Run:
    """One claim transaction's statements, on ``conn``, with ``store``'s named queries."""

    def __init__(self, store: Store, conn: psycopg.Connection[Any], marks: ScanMarks | None) -> None:
        self.store = store
        self.conn = conn
        self.marks = marks
        # The store's named queries, bound to its table (the store's own mapping, not a copy).
        self.q = store._q
        self.db_now: datetime | None = None
        self.params = ClaimParams(lease=0.0, owner="", max_attempts=0, event_types=None)
        #: What the first statement probed; None: not probed.
        self.probes: Probes | None = None

    def rows(self, cls: type[_R], query: str, params: Mapping[str, Any]) -> list[_R]:
        """Run named query ``query``; its rows as ``cls``, by column name (:mod:`outbox_celery.db.rows`)."""
        return _rows.read(self.conn, cls, self.q[query], params)

    def run(self, query: str, params: Mapping[str, Any]) -> int:
        """Run named query ``query`` for its effect; the number of rows it returned."""
        cur = self.conn.execute(self.q[query], params)
        return len(cur.fetchall()) if cur.description is not None else 0

    # -- settings and flow --

    def settings(self, *, lock: bool = False) -> tuple[Seen, bool]:
        """The claim's first statement (DESIGN invariant 25: the one flow read of a claim with no
        limit declared and nothing paused or held), and whether it got the claim lock when
        ``lock`` asks for it (DESIGN invariant 16); True when it does not. It probes the
        expired and heads ranges from the scan bounds in :attr:`params` (``claim_probes``)."""
        params = self.params.sql(claim_lock=lock, table=self.store.quoted)
        query = "claim_settings_flow" if self.store.flow_ready(self.conn) else "claim_settings"
        [row] = self.rows(SettingsRow, query, params)
        if row.heads_due is not None:
            p = self.params
            self.probes = Probes(p.expired_since, p.heads_since, row.first_expired, row.heads_due)
        return row.seen(), row.locked is not False

    def read_flow(self, limits: Mapping[str, Limit], seen: Seen) -> tuple[plan.FlowPlan, FlowRead | None]:
        """Lock and read the flow rows the planner names; the allowance of every limited type
        (invariant 22). Nothing to lock: no statement."""
        flow_plan = plan.plan_flow(limits, seen)
        if not self.store.flow_ready(self.conn):
            _warn_flow_missing(self.store)
            return flow_plan, None
        if not flow_plan.lock:
            return flow_plan, plan.flow_read(flow_plan, seen, (), {})
        if flow_plan.add:
            self.run("flow_add", {"types": list(flow_plan.add)})
        rows = self.rows(FlowRow, "flow_lock", {"limited": list(flow_plan.lock)})
        if flow_plan.clear_keys:
            self.run("flow_keys_clear", {"types": list(flow_plan.clear_keys)})
        live: dict[str, int] = {}
        bounded = plan.to_count(flow_plan, plan.held_after_lock(flow_plan, seen, rows))
        if bounded:
            # After the lock: a new snapshot (read committed) that holds every earlier claimer's
            # claims of these types. Rate-only types need no count.
            counted = self.rows(LiveRow, "flow_live", {"limited": list(bounded)})
            live = {r.event_type: r.live for r in counted}
        return flow_plan, plan.flow_read(flow_plan, seen, rows, live)

    def filling(
        self, fill: Mapping[str, tuple[int, float]], limit: int, excluded: frozenset[str]
    ) -> dict[str, float]:
        """Batch handlers' types left out of this claim's pending statement (invariant 21)."""
        asks = plan.fill_asks(fill, limit, excluded)
        if not asks:
            return {}
        types = list(asks)
        since = self.params.pending_since
        params = {"types": types, "limits": [asks[t] for t in types], "since": [since] * len(types)}
        return plan.filling(fill, limit, self.rows(FillRow, "fill_due", params))

    # -- maintenance --

    def first_expired(self) -> bool:
        """Whether a lease ran out since the expired mark; if one did, the expired scans start
        at the earliest (``first_expired``): one walk of the lease index's range for the four
        statements that read it (DESIGN invariant 18). The first statement's probe answers it
        when the expired scan's bound is still the one it probed from; else the statement runs."""
        probes = self.probes
        if probes is not None and probes.expired_since == self.params.expired_since:
            first = probes.first_expired
        else:
            rows = self.rows(FirstExpiredRow, "first_expired", self.params.sql())
            first = rows[0].lease_until if rows else None
        if first is None:
            return False
        self.params = replace(self.params, expired_since=first)
        return True

    def made_due(self) -> None:
        """Rows made pending in this transaction (given back, fanned out): a head may be due."""
        if self.probes is not None:
            self.probes = replace(self.probes, heads_due=True)

    def heads_due(self) -> bool:
        """Whether ``claim_heads`` can take a row: False only when the first statement probed the
        heads' range from this claim's bound and found no head due (``claim_probes``)."""
        probes = self.probes
        return probes is None or probes.heads_since != self.params.heads_since or probes.heads_due

    def maintenance(self, *, lease: float, unroutable_delay: float, keyed: bool) -> Maintenance:
        """Lost and unroutable expired leases back to pending (no attempt spent), exhausted ones
        dead, a keyed type's expired started leases back to pending (invariants 5, 10, 24)."""
        if not self.first_expired():
            return Maintenance(0, 0, 0, False, expired=False)
        more = {"limit": EXPIRED_BATCH, "lease": lease, "unroutable_delay": unroutable_delay}
        released = self.rows(ReleasedRow, "release_expired", self.params.sql(**more))
        lost, unroutable = log_released(released, self.store)
        table = self.store.quoted
        reaped = self.rows(ReapedRow, "reap", self.params.sql(limit=EXPIRED_BATCH, table=table))
        log_reaped(reaped, self.store)
        full = len(released) >= EXPIRED_BATCH or len(reaped) >= EXPIRED_BATCH
        n = 0
        if keyed:
            # Their expired started leases go back to pending, then through claim_keyed.
            n = self.run("release_keyed_expired", self.params.sql(limit=EXPIRED_BATCH))
            full = full or n >= EXPIRED_BATCH
        if released or n:
            self.made_due()
        return Maintenance(lost, unroutable, len(reaped), full)

    # -- claiming statements --

    def claim_rows(
        self, query: str, limit: int, mark: str | None = None, params: ClaimParams | None = None
    ) -> list[Claimed]:
        """Run one general claiming statement; move ``mark`` on when given (invariant 18)."""
        rows = self.rows(ClaimedRow, query, (params or self.params).sql(limit=limit))
        if self.marks is not None and mark is not None and self.db_now is not None:
            setattr(self.marks, mark, ScanMarks.moved(limit, rows, self.db_now))
        return [r.claimed() for r in rows]

    def claim_limited(
        self, query: str, scan: str, asks: Mapping[str, int], *, move: bool = True
    ) -> dict[str, list[Claimed]]:
        """One statement claiming up to ``asks[t]`` rows of each limited type ``t``, each from
        its own mark (``marks.typed``, invariant 18), which moves on unless ``move`` is false."""
        asks = {t: n for t, n in sorted(asks.items()) if n > 0}
        if not asks:
            return {}
        types = list(asks)
        marks = self.marks
        since = [marks.since(marks.typed.get((scan, t))) if marks else None for t in types]
        params = self.params.sql(types=types, limits=[asks[t] for t in types], since=since)
        raw: dict[str, list[ClaimedRow]] = {t: [] for t in types}
        for r in self.rows(ClaimedRow, query, params):
            raw[r.event_type].append(r)
        if marks is not None and self.db_now is not None and move:
            for t in types:
                marks.typed[(scan, t)] = ScanMarks.moved(asks[t], raw[t], self.db_now)
        return {t: [r.claimed() for r in rows] for t, rows in raw.items()}

    def claim_keyed(
        self, event_type: str, room: int, walk: KeyWalk, batch: int
    ) -> tuple[KeyWalk, list[Claimed]]:
        """Up to ``room`` rows of a keyed type that carry a limit key, round robin between its
        keys, none of a key at its cap or held (``claim_keyed``, DESIGN invariant 24)."""
        params = self.params.sql(
            event_type=event_type,
            n=room,
            key_cap=walk.key_cap,
            key_rate=walk.key_rate,
            key_burst=walk.key_burst,
            after=walk.cursor,
            max_keys=walk.max_keys(room, batch),
        )
        rows = self.rows(KeyedRow, "claim_keyed", params)
        taken = [
            Claimed(r.id, r.lease_version, r.event_type, r.lease_until, r.attempts or 0)
            for r in rows
            if r.id is not None and r.lease_version is not None and r.event_type and r.lease_until
        ]
        return walk.after(rows, room), taken

    def claim_fresh(self, room: int) -> list[Claimed]:
        """Ordered heads and unordered pending rows sharing ``room`` (neither starves)."""
        claimed: list[Claimed] = []
        heads_short = False
        if room > 0:
            share = plan.half(room)
            heads: list[Claimed] = []
            if self.heads_due():
                heads = self.claim_rows("claim_heads", share, "heads")
            elif self.marks is not None and self.db_now is not None:
                self.marks.heads = self.db_now  # as if the statement ran and took none
            # Fewer heads than asked: no other head is claimable now, do not ask again.
            heads_short = len(heads) < share
            claimed += heads
        left = room - len(claimed)
        if left > 0:
            # Types filling a batch (max_wait) are left out of the pending rows only.
            pending = self.params
            if pending.excluded_pending is not None:
                pending = replace(pending, excluded=pending.excluded_pending)
            claimed += self.claim_rows("claim_pending", left, "pending", pending)
        left = room - len(claimed)
        if left > 0 and len(claimed) > 0 and not heads_short:
            # Pending rows ran short: let ordered heads use the rest of the batch.
            claimed += self.claim_rows("claim_heads", left, "heads")
        return claimed

    def claim_fresh_limited(
        self, rooms: Mapping[str, int], walks: dict[str, KeyWalk], batch: int
    ) -> dict[str, list[Claimed]]:
        """:meth:`claim_fresh` for every limited type at once: a keyed type's keyed rows first
        (``walks`` updated), then heads and pending rows share each type's room."""
        rooms = {t: r for t, r in rooms.items() if r > 0}
        by_key: dict[str, list[Claimed]] = {}
        for t, walk in list(walks.items()):
            if t in rooms:
                walks[t], by_key[t] = self.claim_keyed(t, rooms[t], walk, batch)
        rooms = {t: r - len(by_key.get(t, ())) for t, r in rooms.items()}
        rooms = {t: r for t, r in rooms.items() if r > 0}
        got: dict[str, list[Claimed]] = {t: [] for t in rooms}
        shares = {t: plan.half(r) for t, r in rooms.items()}
        heads = self.claim_limited("claim_heads_limited", "heads", shares)
        for t, rows in heads.items():
            got[t] += rows
        pending = {t: r - len(got[t]) for t, r in rooms.items()}
        for t, rows in self.claim_limited("claim_pending_limited", "pending", pending).items():
            got[t] += rows
        counts = {t: len(rows) for t, rows in got.items()}
        again = plan.heads_again(rooms, counts, {t: len(r) for t, r in heads.items()}, shares)
        for t, rows in self.claim_limited("claim_heads_limited", "heads", again).items():
            got[t] += rows
        for t, rows in by_key.items():
            got[t] = rows + got.get(t, [])
        return got

    def write_flow(self, writes: plan.FlowWrites) -> None:
        """Write back the flow rows the planner names (each only when it changed)."""
        if writes.cursors:
            types, keys = zip(*writes.cursors, strict=True)
            self.run("flow_key_cursor", {"types": list(types), "keys": list(keys)})
        if writes.buckets:
            types, tokens = zip(*writes.buckets, strict=True)
            self.run("flow_spend", {"types": list(types), "tokens": list(tokens)})
        if writes.at_cap:
            types, flags = zip(*writes.at_cap, strict=True)
            self.run("flow_at_cap", {"types": list(types), "flags": list(flags)})


def _warn_flow_missing(store: Store) -> None:
    """Once per store: its table lacks the flow-control tables, nothing is enforced."""
    if not store._flow_warned:
        store._flow_warned = True
        logger.error(
            "outbox table %s lacks its flow-control tables (migration 0007 not applied, or 0008): "
            "pauses and limits are not enforced until it is (outbox-celery migrate)",
            store.table.qualified,
            extra={"outbox_table": store.table.qualified},
        )


# -- one claim -------------------------------------------------------------------------------------


def claim(
    store: Store,
    conn: psycopg.Connection[Any],
    *,
    limit: int,
    lease: float,
    owner: str,
    max_attempts: int,
    event_types: Sequence[str] | None = None,
    expired_limit: int | None = None,
    unroutable_delay: float = 60.0,
    marks: ScanMarks | None = None,
    limits: Mapping[str, Limit] | None = None,
    fill: Mapping[str, tuple[int, float]] | None = None,
    hold: Collection[str] = (),
    lock: bool = False,
    room: Room | None = None,
) -> ClaimResult:
    """Reap and claim up to ``limit`` rows in one short transaction, then commit. Routes in
    ``hold`` get no new claim, as if paused (their expired leases come back as every route's).

    A claim run's claims (DESIGN invariant 16): ``lock`` takes the table's claim lock in the
    transaction's first statement; when another transaction holds it the claim does nothing and
    its result is not ``locked``. ``room``, called on ``conn`` right after that statement (in
    the transaction, after the lock), returns the ``limit`` and ``hold`` to claim with.

    Order: expired leases with attempts left first (they have waited longest), then ordered
    heads and unordered pending rows share what is left, so neither starves the other. Rows
    whose attempts are exhausted and whose lease expired go ``dead`` (the reap).

    The reap and the re-claim of expired leases (up to ``expired_limit``, default ``limit``) run
    even when ``limit`` is 0: the in-flight bound counts live leases only, and expired ones must
    come back whatever it says (DESIGN invariants 10, 16). Expired claims whose task never
    started (lost) and expired leases of event types not in ``event_types`` (unroutable, after
    ``unroutable_delay``) go back to ``pending`` first, no attempt spent.

    Flow control (DESIGN invariants 22, 23): paused or held types are claimed by nobody; each
    type in ``limits`` by statements of its own, at most its allowance, decided under its flow
    row's lock. With ``marks`` (one per process) the scans start a little behind where the
    previous claim stopped (DESIGN invariant 18); without, at the beginning of their index.

    ``fill`` maps a batch handler's event type to ``(batch, max_wait)`` (DESIGN invariant 21): a
    type whose due unordered rows are fewer than a batch (or than ``limit``) and whose oldest
    due row has been due for less than ``max_wait`` seconds (database clock) is left out of the
    pending statement of this claim; ``flow_wait`` then says when to claim again.
    """
    limits = {t: lim for t, lim in (limits or {}).items() if event_types is None or t in event_types}
    run = _Run(store, conn, marks)
    run.params = ClaimParams(
        lease=lease,
        owner=owner,
        max_attempts=max_attempts,
        event_types=list(event_types) if event_types is not None else None,
    )
    now_mono = time.monotonic()
    if marks is not None:
        # The bounds this claim expects to scan from, probed by its first statement.
        expired_since, heads_since = marks.ahead(now_mono)
        run.params = replace(run.params, expired_since=expired_since, heads_since=heads_since)
    with conn.transaction():
        seen, locked = run.settings(lock=lock)
        if not locked:
            return ClaimResult([], 0, locked=False)
        full = marks.begin(now_mono) if marks is not None else True
        if room is not None:
            limit, hold = room(conn)
        limit = max(0, limit)
        expired_limit = limit if expired_limit is None else max(0, expired_limit)
        if full or (marks is not None and marks.bare):
            # Before claiming: a fanned-out row is claimable in this same claim (invariant 28).
            fanned = fan_out_bare(store, conn)
            if marks is not None:
                marks.bare = fanned >= FAN_OUT_BATCH
            if fanned:
                run.made_due()
        if hold:
            seen = replace(seen, held=seen.held | frozenset(hold))
        run.db_now = seen.now
        if marks is not None and seen.now is not None:
            marks.check_clock(seen.now, now_mono)
        flow_plan, flow = run.read_flow(limits, seen)
        walks = plan.keyed_walks(flow_plan.limits, flow, seen) if flow is not None else {}
        filling = _prepare(run, flow, walks, now_mono, fill=fill, limit=limit)
        done = run.maintenance(lease=lease, unroutable_delay=unroutable_delay, keyed=bool(walks))
        allowances = dict(sorted(flow.allowances.items())) if flow else {}
        spent = dict.fromkeys(allowances, 0)
        claimed = _claim_expired(run, allowances, spent, expired_limit, full=done.full, none=not done.expired)
        claimed += _claim_new(run, allowances, spent, walks, limit)
        wait = plan.flow_wait(
            flow, flow_plan.limits, spent, walks, filling=filling, key_held_for=seen.key_held_for
        )
        if flow is not None:
            run.write_flow(plan.flow_writes(flow, flow_plan.limits, spent, walks))
    store._count("claimed", len(claimed))
    store._count("reaped", done.reaped)
    store._count("lost_tasks", done.lost)
    store._count("unroutable", done.unroutable)
    return ClaimResult(
        claimed,
        done.reaped,
        done.lost,
        done.unroutable,
        flow_wait=wait,
        held=tuple(sorted(flow.held)) if flow else (),
        filling=tuple(sorted(filling)),
        limit=limit,
    )


def _prepare(
    run: _Run,
    flow: FlowRead | None,
    walks: Mapping[str, KeyWalk],
    now_mono: float,
    *,
    fill: Mapping[str, tuple[int, float]] | None,
    limit: int,
) -> dict[str, float]:
    """The claim's shared parameters from the flow read and the marks; the batch handlers' types
    left to fill (returned, and left out of the pending statement)."""
    excluded = frozenset(flow.held) | frozenset(flow.allowances) if flow else frozenset()
    marks = run.marks
    if marks is not None:
        # Every type left out of the general statements (held, limited, claimed key by key):
        # one that comes back finds its rows behind the marks (invariant 25).
        marks.readmit(excluded, now_mono, keyed=frozenset(walks))
    run.params = replace(
        run.params,
        excluded=sorted(excluded),
        keyed=list(walks),
        pending_since=marks.since(marks.pending) if marks else None,
        heads_since=marks.since(marks.heads) if marks else None,
        expired_since=marks.since(marks.expired) if marks else None,
    )
    # Batch handlers with max_wait: left out of claim_pending only (their expired leases and
    # ordered heads are claimed as ever). Not passed to marks.readmit: a type comes back within
    # max_wait <= scan_lookback, so its rows are inside the window.
    filling = run.filling(fill, limit, excluded) if fill and limit > 0 else {}
    if filling:
        run.params = replace(run.params, excluded_pending=sorted(excluded | frozenset(filling)))
    return filling


def _claim_expired(
    run: _Run,
    allowances: Mapping[str, Any],
    spent: dict[str, int],
    expired_limit: int,
    *,
    full: bool,
    none: bool = False,
) -> list[Claimed]:
    """Expired leases with attempts left: a limited type's first, together with its new rows at
    most its allowance (DESIGN invariant 22), in one statement for every limited type; then the
    rest. Each expired mark moves to now() once every lease that ran out by now was seen;
    ``none``: no lease ran out since the general mark (``first_expired``), whose statement is
    then not run."""
    claimed: list[Claimed] = []
    marks, db_now = run.marks, run.db_now
    asks = plan.expired_asks(allowances, expired_limit)
    took = run.claim_limited("claim_expired_limited", "expired", asks, move=False)
    for event_type, rows in took.items():
        if marks and db_now is not None and not full and len(rows) < asks[event_type]:
            marks.typed[("expired", event_type)] = db_now
        claimed += rows
        spent[event_type] += len(rows)
    if none:
        if marks and db_now is not None and not full:
            marks.expired = db_now
    elif expired_limit > 0:
        rows = run.claim_rows("claim_expired", expired_limit)
        claimed += rows
        if marks and db_now is not None and not full and len(rows) < expired_limit:
            # Every lease that ran out by now was seen: the next claim starts here.
            marks.expired = db_now
    return claimed


def _claim_new(
    run: _Run, allowances: Mapping[str, Any], spent: dict[str, int], walks: dict[str, KeyWalk], limit: int
) -> list[Claimed]:
    """New rows: each limited type and the unlimited rest first share the batch, so that neither
    a limited type's backlog nor the others' starves the other; then whoever has more claimable
    takes what is left."""
    claimed: list[Claimed] = []
    share, rooms = plan.fresh_rooms(allowances, spent, limit)
    fresh = 0
    for event_type, rows in run.claim_fresh_limited(rooms, walks, limit).items():
        fresh += len(rows)
        spent[event_type] += len(rows)
        claimed += rows
    general = run.claim_fresh(limit - fresh)
    fresh += len(general)
    claimed += general
    more = plan.more_rooms(allowances, spent, share, limit - fresh)
    for event_type, rows in run.claim_fresh_limited(more, walks, limit).items():
        spent[event_type] += len(rows)
        claimed += rows
    return claimed
