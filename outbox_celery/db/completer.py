"""The completer: every fenced transition of a claimed row, for one row or many.

A delivery moves a claimed row through two fenced writes: the start (count the attempt, extend
the lease, return the message) and the finalize (what the handler's outcome says). Both are
fenced (DESIGN invariant 4): a write changes a row only while it is ``processing`` under the
``lease_version`` of the claim the caller came from.

Every finalize is a :class:`Finish` value (a :class:`Lease`, a :class:`Step`, a delay and an
error text) and every list of them goes through :meth:`Completer.finish`: one statement
(``finish`` in ``sql/queries.sql``), where each step's rule is written once. The one-message
handler, batch handlers, transactional handlers, the done batcher and the claim's release of
unpublished rows all call it, with one value or many. Two steps need statements more, in the
same transaction: an ordered ``done`` takes its key's producer lock first (``lock_key_of``) and
hands the key its next head after (``settle_heads``, invariant 9), and a ``rate_limited`` row
holds its event type or key after it (``flow_hold``, invariant 23). A final step of a group's
member (or of a row not known to be of no group, :attr:`Finish.grouped`) is finished by
``finish_grouped``, the same update with the group's count after it in the same statement; the
last member enqueues the group's callback there (invariant 29). A step that never makes a row
done or dead (not ``final`` in :data:`outcomes.STEPS <outbox_celery.outcomes.STEPS>`) counts in
no group: ``finish`` writes it for any row.

The completer runs its statements through the :class:`~outbox_celery.db.store.Store` it belongs
to: its named queries, counters and transaction rules (a single statement on an autocommit
connection is its own transaction; ``synchronous_commit = off`` for starts and all-done
finalizes when the store owns the transaction).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple, Protocol, TypeVar

import psycopg
import psycopg.adapt
from psycopg.rows import RowFactory

from .. import outcomes
from ..errors import PayloadError
from ..message import Message, Status
from ..outcomes import Outcome, Step
from ..table import TableName
from . import rows as _rows

__all__ = [
    "INLINE_BYTES",
    "LOST",
    "START_KEEP",
    "Completer",
    "Finalized",
    "FinalizedMany",
    "Finish",
    "Lease",
    "Step",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Stored payload bytes one start result carries at most (the first row's always): the payloads
#: of a batch beyond it are read in chunks of at most this many bytes (``payloads``).
INLINE_BYTES = 16 * 1024 * 1024

#: The share of a lease a fenced start leaves as the claim gave it (DESIGN invariant 33): with at
#: least this much of the claim's lease left, the start keeps its ``lease_until`` (an update
#: PostgreSQL can keep on the row's page, HOT); with less, the row gets a whole lease from now.
#: Either way a started handler has at least ``START_KEEP * lease`` ahead of it, above its hard
#: time limit of ``0.9 * lease``.
START_KEEP = 0.975


class Lease(NamedTuple):
    """One claim of one row: the row's id and the ``lease_version`` its claim wrote (the fence).

    A named tuple: it unpacks and compares as the ``(id, lease_version)`` pair it replaces.
    """

    id: int
    lease_version: int

    @classmethod
    def of(cls, pair: Lease | tuple[int, int]) -> Lease:
        """A lease from a :class:`Lease` or an ``(id, lease_version)`` pair."""
        return pair if isinstance(pair, Lease) else cls(int(pair[0]), int(pair[1]))


@dataclass(frozen=True, slots=True)
class Finalized:
    """What one fenced write of a row did (:meth:`FinalizedMany.of`).

    :ivar status: the row's status after the write, ``None`` when it changed nothing: the
        lease was lost (a newer claim, a finished or released row; counted and logged). A retry
        or defer past its limit says :attr:`Status.DEAD <outbox_celery.message.Status.DEAD>`;
        an ``error`` step leaves the row ``processing``.

    True in a boolean context exactly when the write applied.
    """

    status: Status | None

    @property
    def applied(self) -> bool:
        """The fence held: the write changed the row."""
        return self.status is not None

    def __bool__(self) -> bool:
        return self.applied


#: The result of a fenced write that lost its lease.
LOST = Finalized(None)


@dataclass(frozen=True, slots=True)
class FinalizedMany:
    """What one fenced write of one row or many did (:meth:`Completer.finish`).

    :ivar statuses: the new status of each row the write changed, by id.
    :ivar lost: the ids it left alone: their lease was lost (counted and logged).
    """

    statuses: Mapping[int, Status]
    lost: frozenset[int]

    @property
    def applied(self) -> frozenset[int]:
        """The ids whose fence held."""
        return frozenset(self.statuses)

    def of(self, outbox_id: int) -> Finalized:
        """The one-row view of ``outbox_id``'s write."""
        status = self.statuses.get(outbox_id)
        return LOST if status is None else Finalized(status)


@dataclass(frozen=True, slots=True)
class Finish:
    """One finalize: write ``step`` to the row of ``lease``, fenced on its version.

    :ivar delay: seconds until the row is due again (retry, defer, rate_limited, postpone).
    :ivar error: the text for ``last_error`` (a defer's or RateLimited's reason).
    :ivar ordered: for a ``done``: whether the row has an ordering key (the worker knows it from
        the fenced start). ``True`` takes the key's lock and moves its head (invariant 9);
        ``None`` (unknown) does the same, the lock statement locking nothing for an unordered
        row; ``False`` refuses an ordered row (left as it is, counted as a lost lease).
    """

    lease: Lease
    step: Step
    delay: float = 0.0
    error: str = ""
    ordered: bool | None = False
    #: Whether the row is a group's member (the worker knows it from the fenced start, DESIGN
    #: invariant 29): ``False`` runs ``finish``, which leaves a member alone (a lost lease);
    #: ``True`` or ``None`` (unknown) run ``finish_grouped``, which counts a member's final
    #: outcome in its group. A step that is never final (error, postpone, release, hand_back)
    #: runs ``finish`` whatever this says: it counts in no group.
    grouped: bool | None = None

    @property
    def locks_key(self) -> bool:
        """Whether this finish needs its key's producer lock first (an ordered done)."""
        return self.step is Step.DONE and self.ordered is not False


@dataclass(frozen=True, slots=True)
class StartedRow:
    """A row of ``start`` and ``resume``: what the fenced start hands to the handler."""

    id: int
    event_type: str
    aggregate_type: str
    aggregate_id: str
    payload: Any
    payload_bytes: int
    payload_inline: bool
    attempts: int
    created_at: datetime
    lease_version: int
    ordering_key: str | None
    trace_context: Any
    group_id: int | None

    def as_mapping(self, payload: Any) -> dict[str, Any]:
        """The row by column name, with ``payload`` (inline or read in a chunk)."""
        return {
            "id": self.id,
            "event_type": self.event_type,
            "aggregate_type": self.aggregate_type,
            "aggregate_id": self.aggregate_id,
            "payload": payload,
            "attempts": self.attempts,
            "created_at": self.created_at,
            "lease_version": self.lease_version,
            "ordering_key": self.ordering_key,
            "trace_context": self.trace_context,
            "group_id": self.group_id,
        }


@dataclass(frozen=True, slots=True)
class PayloadRow:
    """A row of ``payloads``."""

    id: int
    payload: Any


@dataclass(frozen=True, slots=True)
class IdRow:
    """A row of the statements that return the ids they changed."""

    id: int


@dataclass(frozen=True, slots=True)
class FinishedRow:
    """A row of ``finish``: one row whose fenced finalize won."""

    id: int
    status: str
    outcome: str
    event_type: str
    limit_key: str | None
    ordering_key: str | None
    delay: float


# Row factories of the statements' results, made once.
_STARTED = _rows.factory(StartedRow)
_FINISHED = _rows.factory(FinishedRow)
_IDS = _rows.factory(IdRow)
_PAYLOADS = _rows.factory(PayloadRow)


def chunks(rows: Iterable[StartedRow], budget: int) -> list[list[int]]:
    """The ids of ``rows`` cut, in order, into groups of at most ``budget`` stored payload bytes
    (a group holds at least one row)."""
    out: list[list[int]] = []
    size = budget + 1
    for row in rows:
        if not out or size + row.payload_bytes > budget:
            out.append([])
            size = 0
        out[-1].append(row.id)
        size += row.payload_bytes
    return out


class Statements(Protocol):
    """What the completer needs of its :class:`~outbox_celery.db.store.Store`: the table's named
    statements (and their one-row forms), its counters, its transaction rules, its messages."""

    table: TableName
    #: The named statements (composed SQL), and the one-row forms of those that have one.
    _q: Mapping[str, Any]
    _one: Mapping[str, Any]

    def _count(self, key: str, n: int = 1) -> None: ...

    def _owns_transaction(self, conn: psycopg.Connection[Any]) -> bool: ...

    def _single_statement(self, conn: psycopg.Connection[Any]) -> AbstractContextManager[Any]: ...

    def _commit_mode(self, conn: psycopg.Connection[Any]) -> str | None: ...

    #: The table's name, quoted, for the statements that resolve it to its oid in SQL.
    quoted: str

    def _message(self, conn: psycopg.Connection[Any], row: dict[str, Any]) -> Message: ...


class Completer:
    """The fenced transitions of one :class:`~outbox_celery.db.store.Store`'s table.

    :param store: the store whose named queries, counters and commit rules it uses.
    :param inline_bytes: stored payload bytes one start result carries at most
        (:data:`INLINE_BYTES`).
    """

    def __init__(self, store: Statements, *, inline_bytes: int = INLINE_BYTES) -> None:
        if inline_bytes < 1:
            raise ValueError("inline_bytes must be >= 1")
        self.store = store
        self.inline_bytes = inline_bytes

    # -- start ---------------------------------------------------------------------------------

    def start(
        self,
        conn: psycopg.Connection[Any],
        leases: Sequence[Lease],
        *,
        lease: float,
        max_attempts: int,
        starter: str,
        resume: bool = True,
        undecodable: dict[int, Exception] | None = None,
    ) -> list[Message]:
        """The fenced start of one claim or many; the started messages, sorted by id.

        A started row whose payload this process cannot decode (a type no ``register_type`` of
        it knows, a payload written by SQL nested deeper than the decoder goes) fails the
        whole call, unless ``undecodable`` is given: it is then left out of the result and its
        error put there by id, and the other rows are handed over.

        Each lease is fenced on its own version (invariant 3); those it does not start (stale,
        already started, no attempt left) are left out. Only when some lease found nothing:
        with ``resume``, the retry of a start whose reply was lost gets its rows back under the
        same ``starter`` (no attempt counted again); then a claim that never started and has no
        attempt left goes ``dead``. Payloads beyond ``inline_bytes`` are read in chunks.
        """
        store = self.store
        params: dict[str, Any] = {
            **self._leases(leases),
            "lease": lease,
            "keep": START_KEEP,
            "max_attempts": max_attempts,
            "commit_mode": store._commit_mode(conn),
            "starter": starter,
            # The table, for a group's callback that a dead start completes (invariant 29).
            "table": self.store.quoted,
            # Each row's share of the stored payload bytes one result may carry.
            "inline_share": self.inline_bytes // max(1, len(leases)),
        }
        rows = self._started(conn, "start", params)
        store._count("started", len(rows))
        missing = self._missing(leases, rows) if len(rows) < len(leases) else []
        if missing and resume:
            resumed = self._started(conn, "resume", self._for(params, missing))
            store._count("resumed_starts", len(resumed))
            rows += resumed
            missing = self._missing(missing, resumed)
        if missing:
            # Its own statement: it re-checks the fence, whatever happened in between.
            with store._single_statement(conn):
                cur = conn.cursor(row_factory=_IDS)
                query = self._query("start_exhausted", len(missing))
                dead = {r.id for r in cur.execute(query, self._for(params, missing))}
            for x in missing:
                self._refused_start(x, dead=x.id in dead)
        left_out = [r for r in rows if not r.payload_inline]
        payloads = self._payloads(conn, left_out) if left_out else {}
        if len(rows) > 1:
            rows.sort(key=lambda r: r.id)
        messages = []
        for r in rows:
            try:
                messages.append(
                    store._message(conn, r.as_mapping(r.payload if r.payload_inline else payloads[r.id]))
                )
            except (PayloadError, RecursionError) as exc:
                if undecodable is None:
                    raise
                undecodable[r.id] = exc
        return messages

    def _started(self, conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> list[StartedRow]:
        with self.store._single_statement(conn):
            cur = conn.cursor(row_factory=_STARTED)
            return cur.execute(self._query(query, len(params["ids"])), params).fetchall()

    @staticmethod
    def _missing(leases: Sequence[Lease], rows: Sequence[StartedRow]) -> list[Lease]:
        got = {r.id for r in rows}
        return [x for x in leases if x.id not in got]

    @staticmethod
    def _leases(leases: Sequence[Lease]) -> dict[str, Any]:
        """The parameters of ``{leases}`` (arrays) and of its one-row form (the first lease)."""
        return {
            "ids": [x.id for x in leases],
            "lease_versions": [x.lease_version for x in leases],
            "id": leases[0].id if leases else None,
            "lease_version": leases[0].lease_version if leases else None,
        }

    @classmethod
    def _for(cls, params: dict[str, Any], leases: Sequence[Lease]) -> dict[str, Any]:
        return {**params, **cls._leases(leases)}

    def _query(self, name: str, rows: int) -> Any:
        """The named statement, in its one-row form for one row when it has one (_sql.one_row)."""
        if rows == 1:
            one = self.store._one.get(name)
            if one is not None:
                return one
        return self.store._q[name]

    def _payloads(self, conn: psycopg.Connection[Any], rows: Sequence[StartedRow]) -> dict[int, Any]:
        """The payloads a start left out of its result, read ``inline_bytes`` at a time."""
        out: dict[int, Any] = {}
        if not rows:
            return out
        cur = conn.cursor(row_factory=_PAYLOADS)
        for ids in chunks(sorted(rows, key=lambda r: r.id), self.inline_bytes):
            out.update((r.id, r.payload) for r in cur.execute(self.store._q["payloads"], {"ids": ids}))
        return out

    def _refused_start(self, x: Lease, *, dead: bool) -> None:
        """Count (and, when its attempts ran out, log) a start that did not start its row."""
        if not dead:
            self.store._count(Outcome.STALE.counter)
            return
        self.store._count(Outcome.DEAD.counter)
        logger.error(
            "outbox id %s went dead: attempts exhausted before this run",
            x.id,
            extra={
                "outbox_id": x.id,
                "lease_version": x.lease_version,
                "outcome": "dead",
                "outbox_table": self.store.table.qualified,
            },
        )

    # -- finish --------------------------------------------------------------------------------

    def finish(
        self,
        conn: psycopg.Connection[Any],
        finishes: Sequence[Finish],
        *,
        max_attempts: int,
        max_age: float,
        notify: bool = False,
        joined: bool = False,
    ) -> FinalizedMany:
        """Apply every finish in one fenced statement; what each won, by id.

        An ordered done takes its key's producer lock first, sorted, in the same transaction
        (``lock_key_of``), and its key gets its next head after (``settle_heads``); won
        ``rate_limited`` rows hold their type or key in it after (``flow_hold``). Rows whose
        fence failed are left as they are, counted and logged as lost leases (a release that
        finds its claim started is neither: the worker holds it). The commit is relaxed only
        when every finish is a done. With ``notify`` the statement signals the table's
        listeners at commit.

        :param joined: the statements are the last of the caller's open transaction (a
            transactional handler's, DESIGN invariant 20): run there directly, without the
            savepoint a nested transaction would cost.
        """
        if not finishes:
            return FinalizedMany({}, frozenset())
        store = self.store
        if joined and store._owns_transaction(conn):
            raise RuntimeError("a joined finish needs the caller's open transaction")
        locks = [f.lease.id for f in finishes if f.locks_key]
        steps = {f.step for f in finishes}
        holds = Step.RATE_LIMITED in steps
        params = {
            **self._rows(finishes),
            "max_attempts": max_attempts,
            "max_age": max_age,
            "keys_locked": bool(locks),
            "commit_mode": store._commit_mode(conn) if steps == {Step.DONE} else None,
            "notify": notify,
            "table": self.store.quoted,
        }
        scope: AbstractContextManager[Any]
        if joined:
            scope = contextlib.nullcontext()
        elif locks or holds:
            scope = conn.transaction()
        else:
            scope = store._single_statement(conn)
        with scope:
            # The library's own adapters: a joined finish runs on a transactional handler's
            # connection, which may carry loaders or dumpers the handler registered (invariant 20).
            cur = _own_cursor(conn, _FINISHED)
            if locks:
                cur.execute(store._q["lock_key_of"], {"table": params["table"], "ids": locks})
            # A group's member (or a row not known not to be one) counts a final step in its
            # group in the same statement (invariant 29); the plain statement costs no more than
            # before, and writes the steps that are never final for any row.
            plain = all(f.grouped is False or not outcomes.row(f.step).final for f in finishes)
            name = "finish" if plain else "finish_grouped"
            won = {r.id: r for r in cur.execute(self._query(name, len(finishes)), params).fetchall()}
            keys = sorted({r.ordering_key for r in won.values() if r.outcome == Step.DONE and r.ordering_key})
            if keys:
                # Still under the key locks: each key's next message becomes its head.
                cur.execute(store._q["settle_heads"], {"keys": keys})
            held = [r for r in won.values() if r.outcome == Step.RATE_LIMITED] if holds else []
            if held:
                hold = {
                    "event_types": [r.event_type for r in held],
                    "limit_keys": [r.limit_key for r in held],
                    "delays": [r.delay for r in held],
                    "max_hold": max_age,
                }
                cur.execute(store._q["flow_hold"], hold)
        return self._tally(finishes, won)

    @staticmethod
    def _rows(finishes: Sequence[Finish]) -> dict[str, Any]:
        """The parameters of ``{finishes}``: scalars for its one-row form, else arrays."""
        if len(finishes) == 1:
            [f] = finishes
            return {
                "id": f.lease.id,
                "lease_version": f.lease.lease_version,
                "outcome": str(f.step),
                "delay": float(f.delay),
                "error": f.error,
            }
        return {
            "ids": [f.lease.id for f in finishes],
            "lease_versions": [f.lease.lease_version for f in finishes],
            "outcomes": [str(f.step) for f in finishes],
            "delays": [float(f.delay) for f in finishes],
            "errors": [f.error for f in finishes],
        }

    def _tally(self, finishes: Sequence[Finish], won: dict[int, FinishedRow]) -> FinalizedMany:
        """Count what won, log what lost its lease; the result by id."""
        if len(finishes) == 1 and won:
            [f] = finishes
            status = Status(won[f.lease.id].status)
            self._won(f.step, status)
            return FinalizedMany({f.lease.id: status}, frozenset())
        statuses: dict[int, Status] = {}
        for f in finishes:
            row = won.get(f.lease.id)
            if row is None:
                if f.step is not Step.RELEASE:
                    self._lost(outcomes.row(f.step).operation, f.lease)
                continue
            status = statuses[f.lease.id] = Status(row.status)
            self._won(f.step, status)
        return FinalizedMany(statuses, frozenset(f.lease.id for f in finishes) - statuses.keys())

    def _won(self, step: Step, status: Status) -> None:
        """Count a won write of ``step``: under ``dead`` when it made the row dead (a retry or
        defer past its limit), else under its step's counter (:data:`outcomes.STEPS
        <outbox_celery.outcomes.STEPS>`)."""
        counter = Outcome.DEAD.counter if status is Status.DEAD else outcomes.row(step).counter
        if counter is not None:
            self.store._count(counter)

    def _lost(self, op: str, x: Lease) -> None:
        self.store._count(Outcome.LOST_LEASE.counter)
        logger.warning(
            "lost lease: %s of outbox id %s version %s changed nothing",
            op,
            x.id,
            x.lease_version,
            extra={
                "outbox_id": x.id,
                "lease_version": x.lease_version,
                "outcome": Outcome.LOST_LEASE,
                "operation": op,
                "outbox_table": self.store.table.qualified,
            },
        )

    # -- lease ---------------------------------------------------------------------------------

    def extend(self, conn: psycopg.Connection[Any], leases: Sequence[Lease], *, seconds: float) -> set[int]:
        """Fenced: each lease's ``lease_until = max(lease_until, now() + seconds)``; the ids extended."""
        params = {**self._leases(leases), "seconds": seconds}
        with self.store._single_statement(conn):
            cur = conn.cursor(row_factory=_IDS)
            won = {r.id for r in cur.execute(self._query("extend_lease", len(leases)), params)}
        for x in leases:
            if x.id not in won:
                self._lost("extend_lease", x)
        return won


def _own_cursor(conn: psycopg.Connection[Any], row_factory: RowFactory[T]) -> psycopg.Cursor[T]:
    """A cursor that adapts with psycopg's global adapters, not the connection's.

    A transactional handler's done runs on the handler's own connection (invariant 20), where the
    handler may have registered loaders or dumpers of its own (a text loader that changes what a
    status or an ordering key reads as): the fenced statements must neither read nor write through
    them.
    """
    cur = conn.cursor(row_factory=row_factory)
    cur._adapters = psycopg.adapt.AdaptersMap(psycopg.adapters)
    return cur
