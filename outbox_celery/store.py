"""The only place the dispatcher's SQL runs.

Every method takes a psycopg connection. Methods that own a transaction (claim, start, the
finalizers) open it themselves with ``conn.transaction()``, so they work on pooled autocommit
connections; the producer's insert runs inside the caller's transaction instead. The fenced start
and the finalizers are single statements: on an autocommit connection outside a transaction they
run as their own implicit transaction, which saves the ``BEGIN`` and ``COMMIT`` round trips.

The fenced start and ``done`` commit with ``synchronous_commit = off`` when the store owns the
transaction (see :class:`Store`); everything else, the claim above all, commits durably.

Each finalizer is fenced: it changes the row only when ``status = 'processing'`` and the
``lease_version`` still matches the claim the caller came from, and returns a :class:`Finalized`
(:class:`FinalizedMany` for a batch) that says whether it won and the row's status after it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Generator, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any

import psycopg
from psycopg import pq, sql
from psycopg.rows import tuple_row

from . import _sql, codec
from .complete import LOST, Completer, Finalized, FinalizedMany, Finish, Lease, Step
from .config import TableName
from .errors import ProducerError
from .flow import CAP_RECHECK, LIMIT_RECHECK, Allowance, Limit, allowance
from .message import Message, idempotency_key

__all__ = [
    "LOST",
    "Claimed",
    "Finalized",
    "FinalizedMany",
    "FlowRead",
    "Lease",
    "ScanMarks",
    "Store",
    "starter_token",
]

# Distinct ordering keys one producer call may lock (#21). Each key's lock is held to commit in
# PostgreSQL's shared lock table, whose size is max_locks_per_transaction x (max_connections +
# max_prepared_transactions) for the whole server (6,400 on a stock one): a bulk import of
# 20,000 keys failed with "out of shared memory", and every other session needing a lock failed
# with it meanwhile. Refused before anything is written instead; split such batches.
MAX_ORDERING_KEYS = 1000
#: Seconds a rate bucket may be refilled ahead of the database's now() (concurrent claimers'
#: transactions began at different times); further ahead, the clock stepped back (the same
#: 60 seconds are written in claim_keyed and flow_spend).
CLOCK_STEP = 60.0
#: Limit keys one claim walks per keyed event type, at least and at most (DESIGN invariant 24):
#: twice its room, within these. Keys beyond are walked by the next claims (round robin).
MIN_KEYS_WALKED = 50
MAX_KEYS_WALKED = 1000

# A producer's statement and the plan that yields them (see Store.write_plan).
Statement = tuple[sql.Composed, dict[str, Any]]
WritePlan = Generator[Statement, list[tuple[Any, ...]], list[int]]

logger = logging.getLogger(__name__)

#: The payload of a finished concurrency-limited delivery's notification (#23): a slot is free.
SLOT_FREED = "slot_freed"

# Expired leases handled per statement of a claim (release_expired, reap).
_EXPIRED_BATCH = 1000


def starter_token() -> str:
    """``host:pid:<random>``: names one fenced start (written to ``lease_owner``).

    A start's retry after a lost reply passes the same token and gets its row back
    (:meth:`Store.start`); any other start of the same claim is refused.
    """
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True, slots=True)
class Claimed:
    """A row handed out by a claim: what the delivery task needs to carry."""

    id: int
    lease_version: int
    event_type: str
    lease_until: datetime

    @property
    def lease(self) -> Lease:
        """The claim's lease: what its fenced start and finalize are fenced on."""
        return Lease(self.id, self.lease_version)


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
    #: back (#23); ``None`` when none was kept back. The push listener claims again then.
    flow_wait: float | None = None
    #: Event types this claim left out: paused, or held by a RateLimited outcome.
    held: tuple[str, ...] = ()
    #: Batch handlers' event types whose due rows this claim left to fill a batch (``max_wait``,
    #: #22); ``flow_wait`` is then at most when the oldest of them has waited ``max_wait``.
    filling: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class FlowRead:
    """The flow-control state one claim read under its rows' locks (#23)."""

    #: Types paused or held by a RateLimited outcome: claimed by nobody.
    held: frozenset[str]
    #: Seconds until the earliest RateLimited hold ends (``None``: none).
    held_for: float | None
    #: Allowance of each limited type that is not held.
    allowances: dict[str, Allowance]
    #: Where the next claim of each keyed type starts walking its keys (DESIGN invariant 24).
    cursors: dict[str, str | None] = field(default_factory=dict)
    #: The at_cap flag of each type as the previous claim left it.
    at_cap: dict[str, bool] = field(default_factory=dict)
    #: Rate-limited types whose bucket was refilled ahead of now() (the clock stepped back).
    reclock: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class _Seen:
    """What a claim's first statement read, without a lock (``claim_settings_flow``)."""

    #: The transaction's now().
    now: datetime | None
    #: Event types that have a flow row.
    known: frozenset[str] = frozenset()
    #: Types paused or held by a RateLimited outcome.
    held: frozenset[str] = frozenset()
    #: Seconds until the earliest hold of a type ends.
    held_for: float | None = None
    #: Types with a limit key paused or held (claimed key by key).
    key_types: tuple[str, ...] = ()
    #: Seconds until the earliest hold of a key ends.
    key_held_for: float | None = None


@dataclass(slots=True)
class _Keyed:
    """One keyed event type within one claim (DESIGN invariant 24)."""

    #: Live deliveries at most per limit key (``None``: no bound per key).
    key_cap: int | None
    #: Starts per second at most per limit key, and its bucket's size (``None``: no bound).
    key_rate: float | None
    key_burst: float | None
    #: The key after which this claim walks its keys (round robin).
    cursor: str | None
    #: Whether the cursor moved (written back to the flow row).
    moved: bool = False
    #: Whether a key at its cap had a row due (the listener claims again soon).
    blocked: bool = False
    #: Seconds until a key held by its key_rate alone has its next token (``None``: none).
    token_wait: float | None = None


class ScanMarks:
    """Where one process's claims start their index scans (DESIGN invariant 18).

    A claim steps over every index entry in front of the rows it takes. While a long transaction
    somewhere in the database pins the xmin horizon, VACUUM removes nothing, and the entries of
    rows claimed, started and finished since then stay in front of every scan: the claim slows as
    the pin lasts. The marks remember, per index, where this process's previous claim stopped
    (the database's ``now()`` when it took everything due, else the last row it took), and the
    next claim starts ``lookback`` seconds behind that, so what it steps over is bounded by the
    rows of ``lookback`` seconds, not by the age of the pin.

    A row can still appear behind a mark: one whose producer's transaction committed more than
    ``lookback`` after it began (``available_at`` is the transaction's ``now()``), or one that a
    concurrent transaction held locked. Every ``full_every`` seconds (and on a process's first
    claim) a claim scans from the start of each index instead, and takes those.

    Times are the database's (``now()`` and row values); only the full-pass period is measured
    on this process's monotonic clock, a duration.
    """

    __slots__ = (
        "db_now",
        "excluded",
        "expired",
        "full_at",
        "full_every",
        "full_passes",
        "heads",
        "keyed",
        "lookback",
        "pending",
        "typed",
    )

    def __init__(self, *, lookback: float = 10.0, full_every: float = 60.0) -> None:
        if lookback < 0 or full_every < 0:
            raise ValueError("lookback and full_every are seconds >= 0")
        self.lookback = lookback
        self.full_every = full_every
        self.pending: datetime | None = None
        self.heads: datetime | None = None
        self.expired: datetime | None = None
        #: Monotonic time of the last full pass; None before the first claim.
        self.full_at: float | None = None
        self.full_passes = 0
        #: Marks of the limited event types' own statements, by (scan, event type) (#23).
        self.typed: dict[tuple[str, str], datetime | None] = {}
        #: Event types the previous claim left out of every statement (paused, or held by a
        #: RateLimited outcome): their rows may lie behind the marks (#23).
        self.excluded: frozenset[str] = frozenset()
        #: Event types the previous claim took key by key: their keyed rows were left out of
        #: their own statements, whose marks moved past them (DESIGN invariant 25).
        self.keyed: frozenset[str] = frozenset()
        #: The database's now() of the previous claim.
        self.db_now: datetime | None = None

    def begin(self, monotonic_now: float) -> bool:
        """Start a claim: forget the marks when a full pass is due; return whether it is."""
        if self.full_at is None or not 0 <= monotonic_now - self.full_at < self.full_every:
            self.forget(monotonic_now)
            return True
        return False

    def forget(self, monotonic_now: float) -> None:
        """Make this claim a full pass: every scan starts at the beginning of its index."""
        self.pending = self.heads = self.expired = None
        self.typed.clear()
        self.full_at = monotonic_now
        self.full_passes += 1

    def check_clock(self, db_now: datetime, monotonic_now: float) -> None:
        """A full pass when the database's clock went back more than ``lookback`` since the
        previous claim (a failover to a lagging host): rows written since lie behind marks
        taken on the other clock (DESIGN invariant 25)."""
        stepped_back = self.db_now is not None and db_now < self.db_now - timedelta(seconds=self.lookback)
        if stepped_back and self.full_at != monotonic_now:
            self.forget(monotonic_now)
        self.db_now = db_now

    def readmit(
        self, excluded: frozenset[str], monotonic_now: float, *, keyed: frozenset[str] = frozenset()
    ) -> None:
        """Note the types this claim leaves out; a full pass when one of the last claim's is back.

        While an event type is left out of the general statements (paused, held by a
        RateLimited outcome), they step over its rows and their marks move past them; when it
        comes back (resumed, hold over, limit removed) its rows lie behind the marks, and only a
        scan from the beginning finds them at once (#23).
        """
        if self.excluded - excluded and self.full_at != monotonic_now:
            self.forget(monotonic_now)
        for event_type in self.keyed - keyed:
            # Its keyed rows come back to its own statements: from the start of their index.
            for scan in ("expired", "heads", "pending"):
                self.typed.pop((scan, event_type), None)
        self.excluded = excluded
        self.keyed = keyed

    def since(self, mark: datetime | None) -> datetime | None:
        """The lower bound of a scan whose previous claim stopped at ``mark`` (None: from the start)."""
        return None if mark is None else mark - timedelta(seconds=self.lookback)

    @staticmethod
    def moved(asked: int, rows: Sequence[Sequence[Any]], now: datetime) -> datetime | None:
        """Where a scan's mark goes after a claim statement asked ``asked`` rows and got ``rows``.

        Fewer than asked: every row due at ``now`` was taken, the mark is ``now``. As many: the
        rest starts at the last row taken (its ``available_at``, the fifth column).
        """
        if len(rows) < asked or not rows:
            return now
        latest: datetime = max(r[4] for r in rows)
        return latest


class Store:
    """Named queries bound to one outbox table.

    :param table: ``"name"``, ``"schema.name"`` or a :class:`~outbox_celery.config.TableName`.
    :param relaxed_commit: commit the fenced start and ``done`` with ``synchronous_commit = off``
        when the store owns the transaction (an autocommit connection outside a transaction).
        Default true. Only a PostgreSQL crash can lose such a commit (the WAL writer flushes it
        within about three ``wal_writer_delay``), and losing one means at most a redelivery after
        the lease: a lost ``done`` leaves the row ``processing`` until its lease ends, a lost
        start leaves one handler run uncounted. Any later claim that sees the row commits
        durably and, WAL being sequential, flushes the earlier relaxed commit with it, so
        ordering and fencing hold across a crash. The claim itself always commits durably: its
        new ``lease_version`` goes out in published tasks and must never be rolled back.
    :param queries: replacement texts for named queries of ``sql/queries.sql`` (same name, same
        parameters; ``{table}`` and the index names are bound as identifiers, the file's fragments
        such as ``{claim_picked}`` filled in). For benchmarks and experiments: the text is trusted SQL,
        never user input.
    """

    def __init__(
        self,
        table: str | TableName = "outbox",
        *,
        relaxed_commit: bool = True,
        queries: Mapping[str, str] | None = None,
    ) -> None:
        self.table = TableName.parse(table)
        self.relaxed_commit = relaxed_commit
        self._q: Mapping[str, sql.Composed] = _sql.queries("queries.sql", self.table)
        unknown = set(queries or {}) - set(self._q)
        if unknown:
            raise ValueError(f"no named queries {sorted(unknown)} to replace")
        filled = {
            name: _sql.fill(text, _sql.fragments("queries.sql")) for name, text in (queries or {}).items()
        }
        if filled:
            self._q = {**self._q, **{name: _sql.compose(text, self.table) for name, text in filled.items()}}
        #: The one-row forms of the fenced statements (the completer's calls with one row).
        self._one: Mapping[str, sql.Composed] = _sql.one_row_queries("queries.sql", self.table, filled)
        self._stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()
        self._canonical: str | None = None
        self._instance: str | None = None
        self._flow_ready = False
        self._flow_warned = False
        #: The fenced transitions of this table: start, finalize, lease extension.
        self.completer = Completer(self)

    # -- transactions --------------------------------------------------------------------------

    @staticmethod
    def _owns_transaction(conn: psycopg.Connection[Any]) -> bool:
        return bool(conn.autocommit) and conn.info.transaction_status == pq.TransactionStatus.IDLE

    def _single_statement(self, conn: psycopg.Connection[Any]) -> AbstractContextManager[Any]:
        """The transaction around one fenced statement.

        On an autocommit connection outside a transaction block the statement is its own
        transaction already; ``BEGIN``/``COMMIT`` around it would cost two round trips and change
        nothing. In any other state the statement joins (or opens) a transaction.
        """
        if self._owns_transaction(conn):
            return contextlib.nullcontext()
        return conn.transaction()

    def _commit_mode(self, conn: psycopg.Connection[Any]) -> str | None:
        """``"off"`` where a relaxed commit is allowed; ``None`` keeps the session's setting."""
        return "off" if self.relaxed_commit and self._owns_transaction(conn) else None

    @property
    def queries(self) -> Mapping[str, sql.Composed]:
        """The named queries, bound to this table (read-only)."""
        return MappingProxyType(dict(self._q))

    # -- observability -------------------------------------------------------------------------

    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats[key] += n

    def get_stats(self) -> dict[str, int]:
        """Counters of this process: claims, fenced outcomes, lost leases."""
        with self._stats_lock:
            return dict(self._stats)

    # -- producer ------------------------------------------------------------------------------

    def lock_keys(self, conn: psycopg.Connection[Any], keys: Iterable[str]) -> None:
        """Take the per-key producer locks, all in one statement (sorted: no deadlocks).

        :raises ProducerError: the transaction is not ``READ COMMITTED`` (see
            :meth:`_check_isolation`). Refused before anything is written.
        """
        params = {"table": self._regclass(conn), "keys": list(keys)}
        self._check_isolation(conn.execute(self._q["lock_keys"], params).fetchall())

    @staticmethod
    def _check_isolation(locked: Sequence[Sequence[Any]]) -> None:
        """Refuse ordered events outside ``READ COMMITTED`` (``locked``: lock_keys' rows).

        The insert that follows the key locks decides whether the new row is its key's head from
        what its statement sees; under repeatable read or serializable the snapshot predates the
        lock, so it could miss a message of the key committed meanwhile (two heads) or a head
        finished meanwhile (a key with none).
        """
        level = locked[0][1] if locked else "read committed"
        if level != "read committed":
            raise ProducerError(
                f"ordered events need a READ COMMITTED transaction, this one is {level}: the "
                "head of an ordering key is decided under the key lock, which a snapshot taken "
                "earlier cannot see (DESIGN invariant 9); enqueue unordered events or use "
                "read committed for this transaction"
            )

    def _regclass(self, conn: psycopg.Connection[Any] | None) -> str:
        # The quoted name, resolved to the table's oid in SQL: lock names then do not depend on
        # how the table was spelled ("outbox" or "public.outbox").
        return self.table.identifier().as_string(conn)

    def canonical_name(self, conn: psycopg.Connection[Any]) -> str:
        """``schema.name`` of the table as PostgreSQL resolves it, e.g. ``public.outbox``.

        The base of every idempotency key (``public.outbox:42``): however the table was
        spelled (``outbox``, ``public.outbox``), one message has one key. Resolved once per
        Store, then cached.
        """
        if self._canonical is None:
            row = conn.execute(self._q["canonical_name"], {"table": self._regclass(conn)}).fetchone()
            assert row is not None
            self._canonical = f"{row[0]}.{row[1]}"
        return self._canonical

    def instance(self, conn: psycopg.Connection[Any]) -> str | None:
        """The table's identity (a UUID drawn once by migration 0006), or ``None`` before it.

        The discriminator of idempotency keys (#21): two databases or clusters with an outbox
        of the same name never send the same key. Read once per Store, then cached; a table not
        migrated to 0006 yet gives ``None`` (keys of the previous form, logged) until the
        process restarts.
        """
        if self._instance is None:
            name = self.table.identifier(_sql.INSTANCE_SUFFIX).as_string(conn)
            found = conn.execute(self._q["instance"], {"instance_table": name}).fetchone()
            state = str(found[0]) if found else "missing"
            self._instance = ""
            if state == "ok":
                row = conn.execute(self._q["instance_id"]).fetchone()
                self._instance = str(row[0]) if row else ""
            if not self._instance:
                why = {
                    "missing": "migration 0006 not applied",
                    "denied": f"this role may not read it: GRANT SELECT ON {name} to the workers' role",
                }.get(state, "its row is missing")
                logger.error(
                    "outbox table %s has no readable identity (%s): idempotency keys keep the "
                    "previous form until this is fixed and workers restart",
                    self.table.qualified,
                    why,
                    extra={"outbox_table": self.table.qualified},
                )
        return self._instance or None

    def key_prefix(self, conn: psycopg.Connection[Any]) -> str:
        """What every idempotency key of this table starts with (``<instance>/public.outbox:``)."""
        return idempotency_key(self.canonical_name(conn), 0, self.instance(conn))[:-1]

    def insert(self, conn: psycopg.Connection[Any], row: dict[str, Any]) -> int:
        """Insert one validated row in the caller's transaction (no key lock)."""
        return self._run(conn, self.write_plan([row], lock=False))[0]

    def insert_many(self, conn: psycopg.Connection[Any], rows: Sequence[dict[str, Any]]) -> list[int]:
        """Insert validated rows with one statement; ids come back in input order (no key lock)."""
        return self._run(conn, self.write_plan(rows, lock=False))

    @staticmethod
    def _run(conn: psycopg.Connection[Any], plan: WritePlan) -> list[int]:
        statement = next(plan)
        while True:
            with conn.cursor(row_factory=tuple_row) as cur:
                rows = cur.execute(*statement).fetchall()
            try:
                statement = plan.send(rows)
            except StopIteration as done:
                ids: list[int] = done.value
                return ids

    @staticmethod
    def _many_params(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return {
            "event_types": [r["event_type"] for r in rows],
            "aggregate_types": [r["aggregate_type"] for r in rows],
            "aggregate_ids": [r["aggregate_id"] for r in rows],
            "payloads": [r["payload"] for r in rows],
            "ordering_keys": [r["ordering_key"] for r in rows],
            "delays": [r["delay"] for r in rows],
            "dedup_keys": [r.get("dedup_key") for r in rows],
            "trace_contexts": [r.get("trace_context") for r in rows],
            "limit_keys": [r.get("limit_key") for r in rows],
        }

    def write_plan(
        self, rows: Sequence[dict[str, Any]], *, lock: bool = True, notify: bool = False
    ) -> WritePlan:
        """The producer's statements for validated rows, as a plan without I/O.

        Refuses (:class:`~outbox_celery.errors.ProducerError`, before any statement) rows with
        more than :data:`MAX_ORDERING_KEYS` distinct ordering keys (#21).

        Yields ``(query, params)`` for the key locks (invariant 9), then the insert, then, when
        a dedup key was already taken, the lookup of the row holding it; the caller executes
        each in its transaction and sends back the rows it returned; the plan returns the ids
        in input order. One plan serves every kind of producer connection (psycopg 3 sync and
        async, psycopg2, SQLAlchemy), so locks and inserts cannot diverge. With ``notify`` the
        insert itself signals the table's listeners (they hear it at commit, #11): no extra
        statement, no extra round trip.
        """
        keys = [r["ordering_key"] for r in rows if r["ordering_key"] is not None]
        distinct = len(set(keys))
        if lock and distinct > MAX_ORDERING_KEYS:
            raise ProducerError(
                f"{distinct} distinct ordering keys in one enqueue; the limit is {MAX_ORDERING_KEYS}: "
                "each key's lock is held until commit in PostgreSQL's shared lock table "
                "(max_locks_per_transaction x max_connections for the whole server), which a larger "
                "batch can exhaust ('out of shared memory', for every session). Nothing was written; "
                f"split the events into transactions of at most {MAX_ORDERING_KEYS} keys each"
            )
        if keys and lock:
            locked = yield self._q["lock_keys"], {"table": self._regclass(None), "keys": keys}
            self._check_isolation(locked)
        wake = {"notify": notify, "table": self._regclass(None)}
        if len(rows) == 1:
            params = {"dedup_key": None, "trace_context": None, "limit_key": None, **rows[0], **wake}
            inserted = yield self._q["insert"], params
        else:
            inserted = yield self._q["insert_many"], {**self._many_params(rows), **wake}
        # Identity values are drawn in input order (ORDER BY n), so sorting the ids of the
        # inserted rows without a dedup key restores their input order.
        plain = iter(sorted(int(i) for i, k, *_ in inserted if k is None))
        by_key = {k: int(i) for i, k, *_ in inserted if k is not None}
        missing = sorted({k for r in rows if (k := r.get("dedup_key")) is not None} - by_key.keys())
        if missing:
            # Taken before (or by a concurrent producer that committed while we waited on its
            # row): the row that holds the key answers, and nothing new was written for it.
            found = yield self._q["dedup_ids"], {"keys": missing}
            by_key.update({k: int(i) for i, k in found})
        if lock and len(inserted) < len(rows):
            # Some rows were dropped as duplicates: a dedup key taken before, or one shared by
            # two rows of this batch (the later one is dropped, #21). A dropped row may have been
            # its ordering key's head candidate: hand every such key's head to its lowest
            # unfinished message, still under the key lock (a no-op where the head is right).
            # Keys whose first row in the batch carries no dedup key cannot have lost it.
            first: dict[str, dict[str, Any]] = {}
            for r in rows:
                if r["ordering_key"] is not None:
                    first.setdefault(r["ordering_key"], r)
            unsettled = sorted(k for k, r in first.items() if r.get("dedup_key") is not None)
            if unsettled:
                yield self._q["settle_heads"], {"keys": unsettled}
        gone = sorted({r["dedup_key"] for r in rows if r.get("dedup_key") is not None} - by_key.keys())
        if gone:
            # Only a purge between our insert and the lookup (or a REPEATABLE READ snapshot that
            # cannot see the holder) gets here; the transaction can be retried.
            raise ProducerError(f"dedup key(s) {gone} are held by rows this transaction cannot see; retry")
        return [next(plain) if r.get("dedup_key") is None else by_key[r["dedup_key"]] for r in rows]

    # -- claim ---------------------------------------------------------------------------------

    def try_claim_lock(self, conn: psycopg.Connection[Any]) -> bool:
        """Transaction-level advisory lock: one claim run per table at a time.

        ``conn`` must be inside a transaction that the caller keeps open for the whole claim run
        (on a connection of its own: the claims commit on another); ending that transaction
        releases the lock. Nothing lives in the session, so it holds behind PgBouncer in
        transaction pooling, where a session lock could be taken on one server connection and
        "released" on another, leaving every later run skipped.
        """
        if conn.info.transaction_status != pq.TransactionStatus.INTRANS:
            raise RuntimeError("try_claim_lock needs an open transaction (conn.transaction())")
        row = conn.execute(self._q["try_claim_lock"], {"table": self._regclass(conn)}).fetchone()
        return bool(row and row[0])

    def in_flight(self, conn: psycopg.Connection[Any]) -> int:
        """Live leases: rows ``processing`` whose lease has not run out (DESIGN invariant 16)."""
        row = conn.execute(self._q["count_in_flight"]).fetchone()
        return int(row[0]) if row else 0

    def recent_done(self, conn: psycopg.Connection[Any], *, window: float, cap: int) -> int:
        """Rows finished ``done`` in the last ``window`` seconds, counted up to ``cap``."""
        row = conn.execute(self._q["count_recent_done"], {"window": window, "cap": cap}).fetchone()
        return int(row[0]) if row else 0

    def claim(
        self,
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
    ) -> ClaimResult:
        """Reap and claim up to ``limit`` rows in one short transaction, then commit.

        Order: expired leases with attempts left first (they have waited longest), then ordered
        heads and unordered pending rows share what is left, so neither starves the other.
        Rows whose attempts are exhausted and whose lease expired go ``dead`` (the reap).

        The reap and the re-claim of expired leases (up to ``expired_limit``, default ``limit``)
        run even when ``limit`` is 0: the in-flight bound counts live leases only, and expired
        ones must come back whatever it says (DESIGN invariants 10, 16). Expired claims whose
        task never started (lost) and expired leases of event types not in ``event_types``
        (unroutable, after ``unroutable_delay``) go back to ``pending`` first, no attempt spent.

        Flow control (#23, DESIGN invariants 22, 23): event types paused or held by a
        RateLimited outcome are claimed by nobody; each type in ``limits`` is claimed by
        statements of its own, at most its allowance (concurrency left, rate tokens), decided
        under its flow row's lock so that concurrent claimers never hand out more than the
        limit together. Its re-claimed expired leases count against the allowance too.

        With ``marks`` (the claim loop's, one per process) the scans start a little behind where
        the previous claim stopped and move the marks on (DESIGN invariant 18); without, every
        scan starts at the beginning of its index.

        ``fill`` maps a batch handler's event type to ``(batch, max_wait)`` (#22): a type whose
        due unordered rows are fewer than a batch (or than ``limit``) and whose oldest due row has
        been due for less than ``max_wait`` seconds (database clock) is left out of the pending
        statement of this claim (:meth:`_filling`); ``flow_wait`` then says when to claim again.
        """
        limit = max(0, limit)
        expired_limit = limit if expired_limit is None else max(0, expired_limit)
        limits = {t: lim for t, lim in (limits or {}).items() if event_types is None or t in event_types}
        base: dict[str, Any] = {
            "lease": lease,
            "owner": owner,
            "max_attempts": max_attempts,
            "event_types": list(event_types) if event_types is not None else None,
            "excluded": [],
            "keyed": [],
        }
        claimed: list[Claimed] = []
        now_mono = time.monotonic()
        if marks is not None:
            marks.begin(now_mono)
        with conn.transaction():
            seen = self._claim_settings(conn, base["event_types"])
            db_now = seen.now
            if marks is not None and db_now is not None:
                marks.check_clock(db_now, now_mono)
            # A type with a held or paused key is claimed key by key for as long as it is, with
            # whatever limits it declares (none: a Limit without bounds).
            limits = {**dict.fromkeys(seen.key_types, Limit()), **limits}
            flow = self._read_flow(conn, limits, seen)
            excluded = frozenset(flow.held) | frozenset(flow.allowances) if flow else frozenset()
            keyed: dict[str, _Keyed] = {}
            if flow is not None:
                keyed = {
                    t: _Keyed(
                        limits[t].key_concurrency,
                        limits[t].key_rate,
                        limits[t].key_burst if limits[t].key_rate is not None else None,
                        flow.cursors.get(t),
                    )
                    for t in sorted(flow.allowances)
                    if limits[t].keyed or t in seen.key_types
                }
            base["keyed"] = list(keyed)
            if marks is not None:
                # Every type left out of the general statements (held, limited, claimed key by
                # key): one that comes back finds its rows behind the marks (invariant 25).
                marks.readmit(excluded, now_mono, keyed=frozenset(keyed))
            base["excluded"] = sorted(excluded)
            base["pending_since"] = marks.since(marks.pending) if marks else None
            base["heads_since"] = marks.since(marks.heads) if marks else None
            base["expired_since"] = marks.since(marks.expired) if marks else None
            # Batch handlers with max_wait (#22): left out of claim_pending only (their expired
            # leases and ordered heads are claimed as ever). Not passed to marks.readmit: a type
            # comes back within max_wait <= scan_lookback, so its rows are inside the window.
            filling = self._filling(conn, fill, limit, base, excluded) if fill and limit > 0 else {}
            if filling:
                base["excluded_pending"] = sorted(excluded | frozenset(filling))
            lost, unroutable, expired_full = self._release_expired(conn, base, lease, unroutable_delay)
            reaped = conn.execute(self._q["reap"], {**base, "limit": _EXPIRED_BATCH})
            reaped_rows = reaped.fetchall()
            expired_full = expired_full or len(reaped_rows) >= _EXPIRED_BATCH
            for row in reaped_rows:
                logger.warning(
                    "outbox id %s went dead: attempts exhausted and lease expired",
                    row[0],
                    extra={
                        "outbox_id": row[0],
                        "lease_version": row[1],
                        "event_type": row[2],
                        "outcome": "dead",
                        "outbox_table": self.table.qualified,
                    },
                )
            waits: list[float] = []
            if flow is not None and flow.held_for is not None:
                waits.append(flow.held_for)
            if filling:
                waits.append(min(filling.values()))
            if keyed and seen.key_held_for is not None:
                waits.append(seen.key_held_for)
            if keyed:
                # Their expired started leases go back to pending, then through claim_keyed.
                released = conn.execute(self._q["release_keyed_expired"], {**base, "limit": _EXPIRED_BATCH})
                expired_full = expired_full or len(released.fetchall()) >= _EXPIRED_BATCH
            allowances = dict(sorted(flow.allowances.items())) if flow else {}
            spent = dict.fromkeys(allowances, 0)
            # A limited type's expired leases first: together with its new rows at most its
            # allowance (DESIGN invariant 22). One statement for every limited type.
            asks = {t: min(a.rows, expired_limit) for t, a in allowances.items()}
            # From each type's own expired mark (invariant 18); the mark moves by the expired
            # rule below, not by the due-order rule (db_now not given).
            took = self._claim_limited(conn, "claim_expired_limited", "expired", asks, base, marks, None)
            for event_type, rows in took.items():
                if marks and db_now is not None and not expired_full and len(rows) < asks[event_type]:
                    marks.typed[("expired", event_type)] = db_now
                claimed += rows
                spent[event_type] += len(rows)
            if expired_limit > 0:
                rows = self._claim_rows(conn, "claim_expired", base, expired_limit)
                claimed += rows
                if marks and db_now is not None and not expired_full and len(rows) < expired_limit:
                    # Every lease that ran out by now was seen: the next claim starts here.
                    marks.expired = db_now
            # New rows: each limited type and the unlimited rest first share the batch, so that
            # neither a limited type's backlog nor the others' starves the other; then whoever
            # has more claimable takes what is left.
            share = max(1, limit // (len(allowances) + 1))
            rooms = {t: min(a.rows - spent[t], share) for t, a in allowances.items()}
            cap = limit
            if sum(max(0, r) for r in rooms.values()) > cap:
                # A batch smaller than the types: the first types in order get one row each.
                for t in rooms:
                    rooms[t] = min(max(0, rooms[t]), cap)
                    cap -= rooms[t]
            fresh = 0
            for event_type, rows in self._claim_fresh_limited(
                conn, rooms, base, marks, db_now, keyed, limit
            ).items():
                fresh += len(rows)
                spent[event_type] += len(rows)
                claimed += rows
            general = self._claim_fresh(conn, base, limit - fresh, marks, None, db_now)
            fresh += len(general)
            claimed += general
            left = limit - fresh
            more: dict[str, int] = {}
            for event_type, allowed in allowances.items():
                room = min(allowed.rows - spent[event_type], left)
                if room > 0 and spent[event_type] >= share:
                    more[event_type] = room
                    left -= room
            for event_type, rows in self._claim_fresh_limited(
                conn, more, base, marks, db_now, keyed, limit
            ).items():
                spent[event_type] += len(rows)
                claimed += rows
            for event_type, allowed in allowances.items():
                wait = allowed.wait(limits[event_type], spent[event_type])
                if wait is not None:
                    waits.append(wait)
            if any(k.blocked for k in keyed.values()):
                # A key at its key_concurrency: its finishes wake the claim (at_cap, below).
                waits.append(CAP_RECHECK)
            waits += [max(LIMIT_RECHECK, k.token_wait) for k in keyed.values() if k.token_wait is not None]
            moved = {t: k.cursor for t, k in keyed.items() if k.moved}
            if moved:
                conn.execute(self._q["flow_key_cursor"], {"types": list(moved), "keys": list(moved.values())})
            if flow is not None:
                self._spend(conn, flow, spent)
                self._mark_capped(conn, flow, limits, spent, keyed)
        self._count("claimed", len(claimed))
        self._count("reaped", len(reaped_rows))
        self._count("lost_tasks", lost)
        self._count("unroutable", unroutable)
        return ClaimResult(
            claimed,
            len(reaped_rows),
            lost,
            unroutable,
            flow_wait=min(waits) if waits else None,
            held=tuple(sorted(flow.held)) if flow else (),
            filling=tuple(sorted(filling)),
        )

    def _claim_limited(
        self,
        conn: psycopg.Connection[Any],
        query: str,
        scan: str,
        asks: Mapping[str, int],
        base: dict[str, Any],
        marks: ScanMarks | None,
        db_now: datetime | None,
    ) -> dict[str, list[Claimed]]:
        """One statement claiming up to ``asks[t]`` rows of each limited type ``t``.

        Each type's scan starts from its own mark (``marks.typed``, DESIGN invariant 18); with
        ``db_now`` the marks move on as :meth:`_claim_rows` moves the general ones.
        """
        asks = {t: n for t, n in sorted(asks.items()) if n > 0}
        if not asks:
            return {}
        types = list(asks)
        params = {
            **base,
            "types": types,
            "limits": [asks[t] for t in types],
            "since": [marks.since(marks.typed.get((scan, t))) if marks else None for t in types],
        }
        raw: dict[str, list[Any]] = {t: [] for t in types}
        for r in conn.execute(self._q[query], params).fetchall():
            raw[str(r[2])].append(r)
        if marks is not None and db_now is not None:
            for t in types:
                marks.typed[(scan, t)] = ScanMarks.moved(asks[t], raw[t], db_now)
        return {t: [Claimed(int(r[0]), int(r[1]), str(r[2]), r[3]) for r in rows] for t, rows in raw.items()}

    def _claim_fresh_limited(
        self,
        conn: psycopg.Connection[Any],
        rooms: Mapping[str, int],
        base: dict[str, Any],
        marks: ScanMarks | None,
        db_now: datetime | None,
        keyed: Mapping[str, _Keyed] | None = None,
        batch: int = 0,
    ) -> dict[str, list[Claimed]]:
        """:meth:`_claim_fresh` for every limited type at once: heads and pending rows share
        each type's room, three statements whatever the number of types.

        A keyed type (``keyed``) first takes its rows that carry a limit key, key by key
        (:meth:`_claim_keyed`); its rows without one share what is left.
        """
        rooms = {t: r for t, r in rooms.items() if r > 0}
        by_key = {
            t: self._claim_keyed(conn, t, rooms[t], k, base, batch)
            for t, k in (keyed or {}).items()
            if t in rooms
        }
        rooms = {t: r - len(by_key.get(t, ())) for t, r in rooms.items()}
        rooms = {t: r for t, r in rooms.items() if r > 0}
        got: dict[str, list[Claimed]] = {t: [] for t in rooms}
        shares = {t: max(1, (r + 1) // 2) for t, r in rooms.items()}
        heads = self._claim_limited(conn, "claim_heads_limited", "heads", shares, base, marks, db_now)
        for t, rows in heads.items():
            got[t] += rows
        pending = {t: r - len(got[t]) for t, r in rooms.items()}
        for t, rows in self._claim_limited(
            conn, "claim_pending_limited", "pending", pending, base, marks, db_now
        ).items():
            got[t] += rows
        # Pending rows ran short: let ordered heads use the rest of the type's room.
        again = {
            t: r - len(got[t])
            for t, r in rooms.items()
            if got[t] and len(heads.get(t, [])) >= shares[t] and r > len(got[t])
        }
        for t, rows in self._claim_limited(
            conn, "claim_heads_limited", "heads", again, base, marks, db_now
        ).items():
            got[t] += rows
        for t, rows in by_key.items():
            got[t] = rows + got.get(t, [])
        return got

    def _claim_fresh(
        self,
        conn: psycopg.Connection[Any],
        base: dict[str, Any],
        room: int,
        marks: ScanMarks | None,
        event_type: str | None,
        db_now: datetime | None,
    ) -> list[Claimed]:
        """Ordered heads and unordered pending rows sharing ``room`` (neither starves)."""
        claimed: list[Claimed] = []
        heads_short = False
        if room > 0:
            share = max(1, (room + 1) // 2)
            heads = self._claim_rows(conn, "claim_heads", base, share, marks, "heads", db_now, event_type)
            # Fewer heads than asked: no other head is claimable now, do not ask again.
            heads_short = len(heads) < share
            claimed += heads
        left = room - len(claimed)
        if left > 0:
            # Types filling a batch (max_wait, #22) are left out of the pending rows only.
            pending = {**base, "excluded": base["excluded_pending"]} if "excluded_pending" in base else base
            claimed += self._claim_rows(
                conn, "claim_pending", pending, left, marks, "pending", db_now, event_type
            )
        left = room - len(claimed)
        if left > 0 and len(claimed) > 0 and not heads_short:
            # Pending rows ran short: let ordered heads use the rest of the batch.
            claimed += self._claim_rows(conn, "claim_heads", base, left, marks, "heads", db_now, event_type)
        return claimed

    def _claim_keyed(
        self,
        conn: psycopg.Connection[Any],
        event_type: str,
        room: int,
        keyed: _Keyed,
        base: dict[str, Any],
        batch: int,
    ) -> list[Claimed]:
        """Up to ``room`` rows of a keyed type that carry a limit key, round robin between its
        keys, none of a key at its cap or held (``claim_keyed``, DESIGN invariant 24); moves
        the type's key cursor on."""
        params = {
            **base,
            "event_type": event_type,
            "n": room,
            "key_cap": keyed.key_cap,
            "key_rate": keyed.key_rate,
            "key_burst": keyed.key_burst,
            "after": keyed.cursor,
            "max_keys": min(MAX_KEYS_WALKED, max(2 * min(room, max(batch, 1)), MIN_KEYS_WALKED)),
        }
        rows = conn.execute(self._q["claim_keyed"], params).fetchall()
        taken = [r for r in rows if r[0] is not None]
        marker = next((r for r in rows if r[0] is None), None)
        if marker is not None and marker[7]:
            keyed.blocked = True
        if marker is not None and marker[8] is not None:
            wait = float(marker[8])
            keyed.token_wait = wait if keyed.token_wait is None else min(keyed.token_wait, wait)
        if taken and len(taken) >= room:
            # Stopped by the room: the next claim starts after the last key served.
            cursor = max(taken, key=lambda r: int(r[6]))[5]
        else:
            # Every key walked offered what it could: the next claim walks on from the last.
            cursor = marker[5] if marker is not None else None
        if cursor is not None and cursor != keyed.cursor:
            keyed.cursor = str(cursor)
            keyed.moved = True
        return [Claimed(int(r[0]), int(r[1]), str(r[2]), r[3]) for r in taken]

    def _claim_settings(self, conn: psycopg.Connection[Any], event_types: Sequence[str] | None) -> _Seen:
        """The claim's first statement: its settings and ``now()``, and on a table with its flow
        tables what the claim must leave out or claim key by key, read without a lock
        (``claim_settings_flow``): the one flow read of a claim with no limit declared and
        nothing paused or held (DESIGN invariant 25)."""
        if not self.flow_ready(conn):
            row = conn.execute(self._q["claim_settings"]).fetchone()
            return _Seen(now=row[1] if row is not None and len(row) > 1 else None)
        row = conn.execute(self._q["claim_settings_flow"], {"event_types": event_types}).fetchone()
        if row is None:  # pragma: no cover - a SELECT without FROM returns its row
            return _Seen(now=None)
        _jit, now, known, held, held_for, key_types, key_held_for = row
        return _Seen(
            now=now,
            known=frozenset(known),
            held=frozenset(held),
            held_for=None if held_for is None else float(held_for),
            key_types=tuple(key_types),
            key_held_for=None if key_held_for is None else float(key_held_for),
        )

    # -- flow control (#23) --------------------------------------------------------------------

    def flow_ready(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether the flow-control tables (migrations 0007, 0008) exist; cached once they do."""
        if not self._flow_ready:
            name = self.table.identifier(_sql.FLOW_SUFFIX).as_string(conn)
            keys = self.table.identifier(_sql.FLOW_KEY_SUFFIX).as_string(conn)
            params = {"flow_table": name, "flow_key_table": keys}
            row = conn.execute(self._q["flow_exists"], params).fetchone()
            self._flow_ready = bool(row and row[0])
        return self._flow_ready

    def _read_flow(
        self, conn: psycopg.Connection[Any], limits: Mapping[str, Limit], seen: _Seen
    ) -> FlowRead | None:
        """Lock and read the flow rows of the limited types; the allowance of every one
        (invariant 22). Paused and held types come from ``seen`` (no lock needed to leave a
        type out). Nothing at all to lock: no statement."""
        if not self.flow_ready(conn):
            if not self._flow_warned:
                self._flow_warned = True
                logger.error(
                    "outbox table %s lacks its flow-control tables (migration 0007 not applied, or 0008): "
                    "pauses and limits are not enforced until it is (outbox-celery migrate)",
                    self.table.qualified,
                    extra={"outbox_table": self.table.qualified},
                )
            return None
        limited = sorted(limits)
        if not limited:
            return FlowRead(held=seen.held, held_for=seen.held_for, allowances={})
        missing = [t for t in limited if t not in seen.known]
        if missing:
            # First claim that limits a type: its row, before any flow lock (one lock order).
            conn.execute(self._q["flow_add"], {"types": missing})
        rows = conn.execute(self._q["flow_lock"], {"limited": limited}).fetchall()
        locked_held = frozenset(str(r[0]) for r in rows if r[1] or r[2])
        held = (seen.held - frozenset(limited)) | locked_held
        holds = [float(r[3]) for r in rows if r[2] and not r[1]]
        held_for = min(holds + ([] if seen.held_for is None else [seen.held_for]), default=None)
        state = {str(r[0]): r for r in rows}
        keyed_types = [t for t in limited if t in seen.key_types]
        if keyed_types:
            # Holds of keys that ran out, cleared under their type's lock (one lock order).
            conn.execute(self._q["flow_keys_clear"], {"types": keyed_types})
        live: dict[str, int] = {}
        bounded = [t for t in limited if limits[t].concurrency is not None and t not in held]
        if bounded:
            # After the lock: a new snapshot (read committed) that holds every earlier claimer's
            # claims of these types. Rate-only types need no count.
            counted = conn.execute(self._q["flow_live"], {"limited": bounded}).fetchall()
            live = {str(t): int(n) for t, n in counted}
        allowances: dict[str, Allowance] = {}
        reclock: set[str] = set()
        for t, lim in limits.items():
            if t in held or t not in state:
                continue
            since = None if state[t][5] is None else float(state[t][5])
            if since is not None and since < -CLOCK_STEP:
                # Refilled ahead of now(): the database's clock stepped back. Nothing refills for
                # the gap and the bucket counts from now() (written by _spend).
                reclock.add(t)
            allowances[t] = allowance(
                lim,
                live=live.get(t, 0),
                tokens=None if state[t][4] is None else float(state[t][4]),
                since_refill=since,
            )
        cursors = {str(r[0]): None if r[6] is None else str(r[6]) for r in rows}
        at_cap = {str(r[0]): bool(r[7]) for r in rows}
        return FlowRead(
            held=held,
            held_for=held_for,
            allowances=allowances,
            cursors=cursors,
            at_cap=at_cap,
            reclock=frozenset(reclock),
        )

    def _spend(self, conn: psycopg.Connection[Any], flow: FlowRead, spent: Mapping[str, int]) -> None:
        """Write the rate buckets back: the refilled tokens minus what this claim took.

        Only the buckets this claim took from: an untouched bucket refills from its last write
        when next read, exactly as if it had been written now, and each write leaves a row
        version behind (a pinned xmin horizon keeps them, invariant 18), so the versions follow
        the type's starts, bounded by its rate, not the number of claims.
        """
        buckets = {
            t: a.tokens - spent.get(t, 0)
            for t, a in flow.allowances.items()
            if a.tokens is not None and (spent.get(t, 0) > 0 or t in flow.reclock)
        }
        if buckets:
            types = sorted(buckets)
            conn.execute(self._q["flow_spend"], {"types": types, "tokens": [buckets[t] for t in types]})

    def _mark_capped(
        self,
        conn: psycopg.Connection[Any],
        flow: FlowRead,
        limits: Mapping[str, Limit],
        spent: Mapping[str, int],
        keyed: Mapping[str, _Keyed],
    ) -> None:
        """Record which concurrency-limited types this claim left at their limit, or with a key
        at its ``key_concurrency`` and a row due (only changes): their finishes wake the claim."""
        flags = {
            t: a.at_cap(limits[t], spent.get(t, 0)) or (t in keyed and keyed[t].blocked)
            for t, a in flow.allowances.items()
            if limits[t].concurrency is not None or limits[t].key_concurrency is not None
        }
        changed = sorted(t for t, f in flags.items() if f != flow.at_cap.get(t, False))
        if changed:
            conn.execute(self._q["flow_at_cap"], {"types": changed, "flags": [flags[t] for t in changed]})

    def capped(self, conn: psycopg.Connection[Any], event_types: Sequence[str]) -> frozenset[str]:
        """The types among ``event_types`` the last claim left at their concurrency limit
        (empty before migration 0008)."""
        if not event_types or not self.flow_ready(conn):
            return frozenset()
        rows = conn.execute(self._q["flow_capped"], {"types": list(event_types)}).fetchall()
        return frozenset(str(r[0]) for r in rows)

    def _release_expired(
        self, conn: psycopg.Connection[Any], base: dict[str, Any], lease: float, unroutable_delay: float
    ) -> tuple[int, int, bool]:
        """Lost claims and unroutable expired leases back to pending (no attempt spent).

        Returns the lost and unroutable counts and whether the batch was full (more may wait).
        """
        params = {**base, "limit": _EXPIRED_BATCH, "lease": lease, "unroutable_delay": unroutable_delay}
        rows = conn.execute(self._q["release_expired"], params).fetchall()
        lost: Counter[str] = Counter()
        unroutable: Counter[str] = Counter()
        for _id, _version, event_type, routable, _unstarted in rows:
            (lost if routable else unroutable)[str(event_type)] += 1
        for event_type, n in sorted(lost.items()):
            most = max(int(r[4]) for r in rows if r[2] == event_type and r[3])
            logger.warning(
                "outbox: %s claim(s) of %r expired without a worker starting them (up to %s in a "
                "row); back to pending after a delay, no attempt spent. Does its queue have a consumer?",
                n,
                event_type,
                most,
                extra={
                    "event_type": event_type,
                    "outcome": "lost_task",
                    "released": n,
                    "unstarted_claims": most,
                    "outbox_table": self.table.qualified,
                },
            )
        for event_type, n in sorted(unroutable.items()):
            logger.warning(
                "outbox: %s expired lease(s) of %r, which has no handler here: back to pending as "
                "unroutable, no attempt spent",
                n,
                event_type,
                extra={
                    "event_type": event_type,
                    "outcome": "unroutable",
                    "released": n,
                    "outbox_table": self.table.qualified,
                },
            )
        return sum(lost.values()), sum(unroutable.values()), len(rows) >= _EXPIRED_BATCH

    def _claim_rows(
        self,
        conn: psycopg.Connection[Any],
        query: str,
        base: dict[str, Any],
        limit: int,
        marks: ScanMarks | None = None,
        mark: str | None = None,
        db_now: datetime | None = None,
        event_type: str | None = None,
    ) -> list[Claimed]:
        """Run one claiming statement; move ``marks``' ``mark`` on when given (invariant 18).

        With ``event_type`` (a limited type's own statement) the mark is that type's.
        """
        rows = conn.execute(self._q[query], {**base, "limit": limit}).fetchall()
        if marks is not None and mark is not None and db_now is not None:
            moved = ScanMarks.moved(limit, rows, db_now)
            if event_type is None:
                setattr(marks, mark, moved)
            else:
                marks.typed[(mark, event_type)] = moved
        return [Claimed(int(r[0]), int(r[1]), str(r[2]), r[3]) for r in rows]

    def release(self, conn: psycopg.Connection[Any], claims: Sequence[Claimed]) -> int:
        """Give unpublished claims back: ``pending`` now, no attempt spent (invariant 12).

        A claim whose fenced start has run is left alone (a publish that raised although the
        broker got the task): its worker holds the row. Returns how many rows went back.
        """
        if not claims:
            return 0
        with conn.transaction():
            won = self._finish(conn, [Finish(c.lease, Step.RELEASE) for c in claims])
        return len(won.statuses)

    # -- worker side: the fenced transitions, run by the completer (complete.py) ---------------

    def start(
        self,
        conn: psycopg.Connection[Any],
        outbox_id: int,
        lease_version: int,
        *,
        lease: float,
        max_attempts: int,
        starter: str | None = None,
    ) -> Message | None:
        """The fenced start: count the attempt, extend the lease, return the message.

        A claim starts once: ``None`` when the claim is stale (version superseded, row finished
        or released) or already started by another task (a redelivery while the first run holds
        the lease: two runs of one claim at once are refused here). ``None`` too when a claim
        that never started finds every attempt spent, in which case the row goes ``dead``; a
        started claim is never made dead here, the reap judges it when its lease ends.

        :param starter: names this start (:func:`starter_token`; a fresh one by default). Called
            again with the same token after its reply was lost, the start returns the row
            without counting the attempt again.
        """
        started = self.completer.start(
            conn,
            [Lease(outbox_id, lease_version)],
            lease=lease,
            max_attempts=max_attempts,
            starter=starter or starter_token(),
            resume=starter is not None,
        )
        return started[0] if started else None

    def start_many(
        self,
        conn: psycopg.Connection[Any],
        pairs: Sequence[Lease | tuple[int, int]],
        *,
        lease: float,
        max_attempts: int,
        starter: str,
    ) -> list[Message]:
        """The fenced start of a batch: :meth:`start` for many leases (or ``(id, lease_version)``
        pairs) in one statement; the started messages sorted by id (:meth:`Completer.start
        <outbox_celery.complete.Completer.start>`)."""
        leases = [Lease.of(p) for p in pairs]
        return self.completer.start(conn, leases, lease=lease, max_attempts=max_attempts, starter=starter)

    def _finish(self, conn: psycopg.Connection[Any], finishes: Sequence[Finish], **kw: Any) -> FinalizedMany:
        """:meth:`Completer.finish <outbox_celery.complete.Completer.finish>` with limits that the
        given steps do not read (retry's ``max_attempts``, defer's ``max_age``) left at zero."""
        kw.setdefault("max_attempts", 0)
        kw.setdefault("max_age", 0.0)
        return self.completer.finish(conn, finishes, **kw)

    def done(
        self,
        conn: psycopg.Connection[Any],
        outbox_id: int,
        lease_version: int,
        *,
        ordered: bool | None = None,
        joined: bool = False,
    ) -> Finalized:
        """Fenced: ``processing`` -> ``done``; an ordered head hands its key to the next message.

        Unordered rows finish in one statement and take no key lock. An ordered row's done is
        one transaction: the key lock first (the producers' lock), then the fenced done and the
        head's move in one statement whose snapshot follows the lock, so a producer committing
        a message of the key meanwhile is either seen or waits (invariant 9).

        :param ordered: whether the row has an ordering key, when the caller knows (the worker
            does, from the fenced start). ``None`` takes the lock statement too (it locks
            nothing for an unordered row).
        :param joined: the done is the last statement of the caller's open transaction (a
            transactional handler's, DESIGN invariant 20).
        """
        done = [Finish(Lease(outbox_id, lease_version), Step.DONE, ordered=ordered)]
        return self.completer.finish(conn, done, max_attempts=0, max_age=0.0, joined=joined).of(outbox_id)

    def done_many(
        self, conn: psycopg.Connection[Any], finished: Sequence[Lease | tuple[int, int]]
    ) -> FinalizedMany:
        """Fenced: many unordered leases (or ``(id, lease_version)`` pairs) ``done`` at once.

        One statement and one transaction for the whole batch; each row is fenced on its own
        version. Ordered rows are never finished here (left as they are, counted as lost): their
        done moves the key's head under the key lock (:meth:`done`).
        """
        return self._finish(conn, [Finish(Lease.of(p), Step.DONE) for p in finished])

    def finish_many(
        self,
        conn: psycopg.Connection[Any],
        rows: Sequence[tuple[int, int, str, float, str]],
        *,
        max_attempts: int,
        max_age: float,
        notify: bool = False,
    ) -> FinalizedMany:
        """The fenced finalize of a batch: ``(id, lease_version, step, delay, error)`` rows, each
        with its own :class:`~outbox_celery.complete.Step` (an ordered row's done is refused
        here, as in :meth:`done_many`); see :meth:`Completer.finish
        <outbox_celery.complete.Completer.finish>`."""
        finishes = [Finish(Lease(i, v), Step(step), delay, error) for i, v, step, delay, error in rows]
        return self._finish(conn, finishes, max_attempts=max_attempts, max_age=max_age, notify=notify)

    def retry(
        self,
        conn: psycopg.Connection[Any],
        outbox_id: int,
        lease_version: int,
        *,
        delay: float,
        error: str,
        max_attempts: int,
    ) -> Finalized:
        """Fenced retryable failure: the new status is ``pending``, or ``dead`` at the limit."""
        finish = Finish(Lease(outbox_id, lease_version), Step.RETRY, delay, error)
        return self._finish(conn, [finish], max_attempts=max_attempts).of(outbox_id)

    def defer(
        self,
        conn: psycopg.Connection[Any],
        outbox_id: int,
        lease_version: int,
        *,
        delay: float,
        reason: str,
        max_age: float,
    ) -> Finalized:
        """Fenced defer, attempt refunded: the new status is ``pending``, or ``dead`` past ``max_age``."""
        finish = Finish(Lease(outbox_id, lease_version), Step.DEFER, delay, reason)
        return self._finish(conn, [finish], max_age=max_age).of(outbox_id)

    def rate_limited(
        self,
        conn: psycopg.Connection[Any],
        outbox_id: int,
        lease_version: int,
        *,
        delay: float,
        reason: str,
        max_age: float,
    ) -> Finalized:
        """Fenced RateLimited outcome (DESIGN invariant 23): as :meth:`defer`, and in the same
        transaction the row's event type is held until ``now() + delay`` (a row with a limit
        key holds its key only, invariant 24). Nothing is held when the lease was lost."""
        finish = Finish(Lease(outbox_id, lease_version), Step.RATE_LIMITED, delay, reason)
        return self._finish(conn, [finish], max_age=max_age).of(outbox_id)

    def dead(
        self, conn: psycopg.Connection[Any], outbox_id: int, lease_version: int, *, error: str
    ) -> Finalized:
        """Fenced: ``processing`` -> ``dead`` with ``error``."""
        return self._finish(conn, [Finish(Lease(outbox_id, lease_version), Step.DEAD, error=error)]).of(
            outbox_id
        )

    def record_error(
        self, conn: psycopg.Connection[Any], outbox_id: int, lease_version: int, *, error: str
    ) -> Finalized:
        """Fenced: store ``error`` and leave the row (``processing``) to return through its lease."""
        finish = Finish(Lease(outbox_id, lease_version), Step.ERROR, error=error)
        return self._finish(conn, [finish]).of(outbox_id)

    def postpone(
        self,
        conn: psycopg.Connection[Any],
        outbox_id: int,
        lease_version: int,
        *,
        delay: float,
        error: str,
    ) -> Finalized:
        """Fenced: back to pending after ``delay`` with the attempt refunded (no handler here)."""
        finish = Finish(Lease(outbox_id, lease_version), Step.POSTPONE, delay, error)
        return self._finish(conn, [finish]).of(outbox_id)

    def extend_lease(
        self, conn: psycopg.Connection[Any], outbox_id: int, lease_version: int, *, seconds: float
    ) -> bool:
        """Fenced: ``lease_until = max(lease_until, now() + seconds)``; whether the lease held."""
        return bool(self.completer.extend(conn, [Lease(outbox_id, lease_version)], seconds=seconds))

    def extend_leases(
        self, conn: psycopg.Connection[Any], pairs: Sequence[Lease | tuple[int, int]], *, seconds: float
    ) -> set[int]:
        """Fenced :meth:`extend_lease` of many leases in one statement; returns the ids extended."""
        return self.completer.extend(conn, [Lease.of(p) for p in pairs], seconds=seconds)

    def _message(self, conn: psycopg.Connection[Any], row: dict[str, Any]) -> Message:
        return Message(
            id=int(row["id"]),
            event_type=row["event_type"],
            aggregate_type=row["aggregate_type"],
            aggregate_id=row["aggregate_id"],
            # psycopg's json loader, then kombu's object hook (DESIGN invariant 27): what was
            # enqueued, a string included (a str payload is a JSON string, never decoded again).
            payload=codec.decode(row["payload"]),
            attempts=int(row["attempts"]),
            created_at=row["created_at"],
            lease_version=int(row["lease_version"]),
            ordering_key=row["ordering_key"],
            idempotency_key=idempotency_key(self.canonical_name(conn), int(row["id"]), self.instance(conn)),
            trace_context=row.get("trace_context"),
            legacy_idempotency_key=idempotency_key(self.canonical_name(conn), int(row["id"])),
        )

    def follow_ups_at_commit(self, conn: psycopg.Connection[Any], ids: Sequence[int]) -> int:
        """Move rows the caller's open transaction enqueued, already due, to this statement's time.

        A transactional handler's long transaction runs it just before its done (named query
        ``follow_ups_at_commit``, DESIGN invariant 18): its follow-ups then land at its commit,
        in front of the claims' scan marks, not at its start. Returns how many moved.

        :raises RuntimeError: ``conn`` is in autocommit outside a transaction block.
        """
        if self._owns_transaction(conn):
            raise RuntimeError("follow_ups_at_commit needs the transaction that enqueued the rows")
        return conn.execute(self._q["follow_ups_at_commit"], {"ids": list(ids)}).rowcount

    def limit_transaction(self, conn: psycopg.Connection[Any], *, seconds: float) -> str:
        """Bound the caller's open transaction to ``seconds`` (a transactional handler's).

        Sets ``statement_timeout`` and ``idle_in_transaction_session_timeout`` for this
        transaction only, and ``transaction_timeout`` on PostgreSQL 17 and later (named query
        ``transaction_limits``). Returns the transaction's isolation level.

        :raises RuntimeError: ``conn`` would run the statement as its own transaction (an
            autocommit connection outside a transaction block): there is nothing to bound.
        """
        if self._owns_transaction(conn):
            raise RuntimeError("limit_transaction needs a transaction: this connection is in autocommit")
        ms = max(1, round(seconds * 1000))
        row = conn.execute(self._q["transaction_limits"], {"ms": ms}).fetchone()
        assert row is not None
        return str(row[3])

    # -- push (#11) ----------------------------------------------------------------------------

    def notify_channel(self, conn: psycopg.Connection[Any]) -> str:
        """The channel :meth:`notify` signals on (``outbox_celery_<table oid>``)."""
        row = conn.execute(self._q["notify_channel"], {"table": self._regclass(conn)}).fetchone()
        assert row is not None
        return str(row[0])

    def notify(self, conn: psycopg.Connection[Any], payload: str = "") -> None:
        """Signal this table's channel (:meth:`notify_channel`) with ``payload``: the push
        listeners claim again (:data:`SLOT_FREED`: only while a limit holds a type back)."""
        conn.execute(self._q["notify"], {"table": self._regclass(conn), "payload": payload})

    def listen(self, conn: psycopg.Connection[Any]) -> str:
        """``LISTEN`` on this table's channel (a session-level setting); return the channel."""
        channel = self.notify_channel(conn)
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        return channel

    def next_due(
        self, conn: psycopg.Connection[Any], event_types: Sequence[str] | None, *, within: float = 3600.0
    ) -> float | None:
        """Seconds until a delayed row of ``event_types`` or a live lease comes due, or None.

        Only what comes due in the next ``within`` seconds is looked for (None otherwise): the
        listener asks for its poll period, so the probe steps over that window's dead index
        entries only (DESIGN invariant 18).
        """
        params = {"event_types": list(event_types) if event_types is not None else None, "within": within}
        row = conn.execute(self._q["next_due"], params).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    # -- batch handlers' max_wait (#22) --------------------------------------------------------

    def _filling(
        self,
        conn: psycopg.Connection[Any],
        fill: Mapping[str, tuple[int, float]],
        limit: int,
        base: Mapping[str, Any],
        excluded: frozenset[str],
    ) -> dict[str, float]:
        """Batch handlers' event types to leave out of this claim, each with the seconds it may wait.

        One statement (``fill_due``): per type, its due unordered rows counted up to a batch
        (``min(batch, limit)``: a claim never cuts a bigger one) and the age of the oldest, both
        on the database's clock. A type is left to fill when it has due rows, fewer than that,
        and the oldest has been due less than ``max_wait``; it may wait ``max_wait - age`` more.
        Types left out anyway (``excluded``: paused, held, limited) and ``max_wait`` 0 are not read.
        """
        types = sorted(t for t, (_batch, wait) in fill.items() if wait > 0 and t not in excluded)
        if not types:
            return {}
        wanted = [max(1, min(fill[t][0], limit)) for t in types]
        since = base.get("pending_since")
        params = {"types": types, "limits": wanted, "since": [since] * len(types)}
        rows = conn.execute(self._q["fill_due"], params)
        out: dict[str, float] = {}
        for event_type, n, waited in rows.fetchall():
            batch, max_wait = fill[str(event_type)]
            if n == 0 or waited is None or n >= min(batch, limit) or waited >= max_wait:
                continue
            out[str(event_type)] = max(0.0, max_wait - float(waited))
        return out
