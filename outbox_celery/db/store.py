"""The table's statements and the small reads and writes around them.

The claim (``claim/executor.py``) and the completer (``db/completer.py``) run their named
statements through the :class:`Store` of their table.

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
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from types import MappingProxyType
from typing import Any

import psycopg
from psycopg import pq, sql

from .. import codec
from ..claim import executor as _claim
from ..claim.executor import Claimed, ClaimResult, FlowRead, ScanMarks
from ..config import TableName
from ..flow import Limit
from ..message import KEY_SEPARATOR, Message, idempotency_key, split_route
from ..produce.writes import MAX_ORDERING_KEYS, ProducerWrites, Statement, WritePlan
from . import statements as _sql
from .completer import LOST, Completer, Finalized, FinalizedMany, Finish, Lease, Step

__all__ = [
    "LOST",
    "MAX_ORDERING_KEYS",
    "ClaimResult",
    "Claimed",
    "Finalized",
    "FinalizedMany",
    "FlowRead",
    "Lease",
    "ScanMarks",
    "Statement",
    "Store",
    "WritePlan",
    "starter_token",
]

logger = logging.getLogger(__name__)

#: The payload of a finished concurrency-limited delivery's notification: a slot is free.
SLOT_FREED = "slot_freed"


def starter_token() -> str:
    """``host:pid:<random>``: names one fenced start (written to ``lease_owner``).

    A start's retry after a lost reply passes the same token and gets its row back
    (:meth:`Store.start`); any other start of the same claim is refused.
    """
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


class Store(ProducerWrites):
    """Named queries bound to one outbox table, by phase: the producer's writes
    (:class:`~outbox_celery.produce.writes.ProducerWrites`), the claim (``claim.py``, planned by
    ``claim_plan.py``), the fenced transitions (:class:`~outbox_celery.db.completer.Completer`);
    the operators' reads and actions are ``operations.py``.

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

        Planned by :mod:`outbox_celery.claim.plan` and run by :func:`outbox_celery.claim.executor.claim`.

        Order: expired leases with attempts left first (they have waited longest), then ordered
        heads and unordered pending rows share what is left, so neither starves the other.
        Rows whose attempts are exhausted and whose lease expired go ``dead`` (the reap).

        The reap and the re-claim of expired leases (up to ``expired_limit``, default ``limit``)
        run even when ``limit`` is 0: the in-flight bound counts live leases only, and expired
        ones must come back whatever it says (DESIGN invariants 10, 16). Expired claims whose
        task never started (lost) and expired leases of event types not in ``event_types``
        (unroutable, after ``unroutable_delay``) go back to ``pending`` first, no attempt spent.

        Flow control (DESIGN invariants 22, 23): event types paused or held by a
        RateLimited outcome are claimed by nobody; each type in ``limits`` is claimed by
        statements of its own, at most its allowance (concurrency left, rate tokens), decided
        under its flow row's lock so that concurrent claimers never hand out more than the
        limit together. Its re-claimed expired leases count against the allowance too.

        With ``marks`` (the claim loop's, one per process) the scans start a little behind where
        the previous claim stopped and move the marks on (DESIGN invariant 18); without, every
        scan starts at the beginning of its index.

        ``fill`` maps a batch handler's event type to ``(batch, max_wait)`` (DESIGN invariant
        21): a type whose due unordered rows are fewer than a batch (or than ``limit``) and whose
        oldest due row has been due for less than ``max_wait`` seconds (database clock) is left
        out of the pending statement of this claim; ``flow_wait`` then says when to claim again.
        """
        return _claim.claim(
            self,
            conn,
            limit=limit,
            lease=lease,
            owner=owner,
            max_attempts=max_attempts,
            event_types=event_types,
            expired_limit=expired_limit,
            unroutable_delay=unroutable_delay,
            marks=marks,
            limits=limits,
            fill=fill,
        )

    # -- flow control --------------------------------------------------------------------

    def flow_ready(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether the flow-control tables (migrations 0007, 0008) exist; cached once they do."""
        if not self._flow_ready:
            name = self.table.identifier(_sql.FLOW_SUFFIX).as_string(conn)
            keys = self.table.identifier(_sql.FLOW_KEY_SUFFIX).as_string(conn)
            params = {"flow_table": name, "flow_key_table": keys}
            row = conn.execute(self._q["flow_exists"], params).fetchone()
            self._flow_ready = bool(row and row[0])
        return self._flow_ready

    def capped(self, conn: psycopg.Connection[Any], event_types: Sequence[str]) -> frozenset[str]:
        """The types among ``event_types`` the last claim left at their concurrency limit
        (empty before migration 0008)."""
        if not event_types or not self.flow_ready(conn):
            return frozenset()
        rows = conn.execute(self._q["flow_capped"], {"types": list(event_types)}).fetchall()
        return frozenset(str(r[0]) for r in rows)

    def release(self, conn: psycopg.Connection[Any], leases: Sequence[Lease]) -> int:
        """Give the leases of unpublished claims back: ``pending`` now, no attempt spent
        (invariant 12).

        A claim whose fenced start has run is left alone (a publish that raised although the
        broker got the task): its worker holds the row. Returns how many rows went back.
        """
        if not leases:
            return 0
        with conn.transaction():
            finishes = [Finish(x, Step.RELEASE) for x in leases]
            won = self.completer.finish(conn, finishes, max_attempts=0, max_age=0.0)
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
        <outbox_celery.db.completer.Completer.start>`)."""
        leases = [Lease.of(p) for p in pairs]
        return self.completer.start(conn, leases, lease=lease, max_attempts=max_attempts, starter=starter)

    def _finish(self, conn: psycopg.Connection[Any], finishes: Sequence[Finish], **kw: Any) -> FinalizedMany:
        """:meth:`Completer.finish <outbox_celery.db.completer.Completer.finish>` with limits that the
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
        grouped: bool | None = None,
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
        :param grouped: whether the row is a group's member (:attr:`Message.group_id
            <outbox_celery.message.Message.group_id>`), when the caller knows; ``None`` runs the
            statement that counts a member in its group (DESIGN invariant 29), which a row of no
            group goes through too, at a little more cost.
        """
        done = [Finish(Lease(outbox_id, lease_version), Step.DONE, ordered=ordered, grouped=grouped)]
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
        with its own :class:`~outbox_celery.db.completer.Step` (an ordered row's done is refused
        here, as in :meth:`done_many`); see :meth:`Completer.finish
        <outbox_celery.db.completer.Completer.finish>`."""
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
        event_type, subscription = split_route(row["event_type"])
        key = row["ordering_key"]
        return Message(
            id=int(row["id"]),
            event_type=event_type,
            subscription=subscription,
            aggregate_type=row["aggregate_type"],
            aggregate_id=row["aggregate_id"],
            # psycopg's json loader, then kombu's object hook (DESIGN invariant 27): what was
            # enqueued, a string included (a str payload is a JSON string, never decoded again).
            payload=codec.decode(row["payload"]),
            attempts=int(row["attempts"]),
            created_at=row["created_at"],
            lease_version=int(row["lease_version"]),
            # The producer's key, without the subscription's part (invariant 28).
            ordering_key=key.partition(KEY_SEPARATOR)[0] if key is not None else None,
            idempotency_key=idempotency_key(self.canonical_name(conn), int(row["id"]), self.instance(conn)),
            trace_context=row.get("trace_context"),
            legacy_idempotency_key=idempotency_key(self.canonical_name(conn), int(row["id"])),
            group_id=row.get("group_id"),
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

    # -- push ----------------------------------------------------------------------------

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
