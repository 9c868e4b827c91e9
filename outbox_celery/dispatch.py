"""The dispatcher's decisions, with no SQL and no Celery: claim -> publish, deliver -> finalize.

:class:`Dispatcher` is driven by :class:`~outbox_celery.celery_app.Outbox` (the Celery wiring)
and by the benchmarks' plain loop; it asks :class:`~outbox_celery.store.Store` to run queries
and a ``publish`` callable to hand claimed rows to the broker.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Protocol, TypeVar

import psycopg
from psycopg import pq

from ._connections import FOLLOW_UPS, Noted
from ._done_batch import DoneBatcher
from .backoff import Backoff, RetryPolicy
from .batch import BatchDelivery
from .complete import Finish, Lease, Step
from .config import OutboxConfig
from .errors import ConfigurationError, RetryableError, first_line
from .flow import Limit
from .heartbeat import lease_heartbeat
from .message import Message, Outcome
from .slot_wake import SlotWake
from .store import Claimed, FinalizedMany, ScanMarks, Store, starter_token
from .tracing import handler_span
from .transactional import NOTHING_COMMITTED, TransactionKind, TransactionRolledBack
from .verdict import Verdict, _error_text, _ms_since, _outcome_of, classify

__all__ = [
    "BatchResult",
    "ClaimRun",
    "Dispatcher",
    "Handler",
    "HandlerSpec",
    "Outcome",
    "StoppedBy",
    "publish_units",
]

logger = logging.getLogger(__name__)

# Seconds an adaptive in-flight bound is reused by later claim runs of the same process: it
# follows throughput over a whole lease, so recounting it for every run adds statements, not
# precision. Only the bound is reused; the rows in flight are counted on every batch.
BOUND_REFRESH = 1.0

# Seconds of lease a handled message must have left, beyond done_batch_delay, for its done to
# wait for a batch; with less the done is written at once, so it lands inside the lease.
DONE_BATCH_MARGIN = 1.0

# How last_error starts when the library failed before the handler ran (never the handler's fault).
PRE_HANDLER_FAILURE = "outbox-celery failed before calling the handler (the handler did not run)"

T = TypeVar("T")

Handler = Callable[[Message], Any]
#: A transactional handler: ``(message, conn)``, inside the transaction of its fenced done.
TransactionalHandler = Callable[[Message, Any], Any]
#: What a batch handler may return: ``None`` (every message delivered) or, for the messages that
#: were not, their id -> a RetryableError, Defer or PermanentError instance.
BatchResult = Mapping[int, BaseException] | None
ConnectionSource = Callable[[], AbstractContextManager[psycopg.Connection[Any]]]


class Publisher(Protocol):
    """Hands claimed rows to the broker; returns how many were published, in order.

    It stops at the first failure; rows after the returned count are given back.
    """

    def __call__(self, claims: Sequence[Claimed]) -> int: ...


@dataclass(frozen=True, slots=True)
class HandlerSpec:
    """A registered handler and the queue its event type is routed to.

    :ivar transaction: set for a transactional handler (``fn`` then takes ``(message, conn)``
        and runs inside the transaction of its fenced done, DESIGN invariant 20).
    :ivar batch: set for a batch handler (DESIGN invariant 21): ``fn`` takes a list of up
        to ``batch`` messages of this event type and returns ``None`` or a mapping from message
        id to the outcome of those that did not succeed.
    :ivar limit: the event type's global limits, enforced by the claim (docs/flow-control.md).
    """

    event_type: str
    fn: Callable[..., Any]
    queue: str
    transaction: TransactionKind | None = None
    batch: int | None = None
    #: Global concurrency and rate limits of the event type (DESIGN invariant 22).
    limit: Limit | None = None
    #: Seconds a batch handler's due rows may wait for a fuller batch; 0: never wait.
    max_wait: float = 0.0
    #: Rows of a one-message handler one delivery task may carry (invariant 30); 1: one each.
    pack: int = 1


def publish_units(
    claims: Sequence[Claimed], handlers: Mapping[str, HandlerSpec], *, max_attempts: int
) -> list[list[Claimed]]:
    """The delivery tasks of a claim batch: one claim each, a batch handler's batch, or a pack.

    Claims of a batch handler's event type are cut into consecutive groups of at most its
    ``batch``, in claim order. The claims of a type whose handler declares
    ``pack`` that have spent no attempt are cut into as few packs as its ``pack`` allows, of
    even sizes (invariant 30); every other claim is a group of one. The one definition of what a
    delivery task carries: the claim loop orders its rows by it (so that rows after a failed
    publish are exactly the ones not sent) and the publisher sends one task per group. Grouping
    its own output again gives the same groups. A claim holds at most one row per ordering key
    (only heads are claimable), so neither does a group (DESIGN invariant 21).

    :param max_attempts: the outbox's; below 2 nothing is packed: a pack's start spends an
        attempt of each row it carries, and a row may not spend its only one on a neighbour's
        crash.
    """
    packs = max_attempts >= 2
    units: list[list[Claimed]] = []
    filling: dict[str, list[Claimed]] = {}
    packable: dict[str, list[Claimed]] = {}
    for claim in claims:
        spec = handlers.get(claim.event_type)
        if spec is not None and spec.batch:
            unit = filling.get(claim.event_type)
            if unit is None or len(unit) >= spec.batch:
                unit = filling[claim.event_type] = []
                units.append(unit)
            unit.append(claim)
        elif packs and spec is not None and spec.pack > 1 and claim.attempts == 0:
            packable.setdefault(claim.event_type, []).append(claim)
        else:
            units.append([claim])
    for event_type, rows in packable.items():
        n = -(-len(rows) // handlers[event_type].pack)
        units.extend(rows[i * len(rows) // n : (i + 1) * len(rows) // n] for i in range(n))
    return units


class StoppedBy(StrEnum):
    """Why a claim run ended (a string: the claim task's result and logs carry its value)."""

    #: The app has no handler: nothing to claim.
    NO_HANDLERS = "no_handlers"
    #: Another process's run held the claim lock; this one was skipped.
    ANOTHER_CLAIM_RUNNING = "another_claim_running"
    #: A publish failed; the unpublished rows were released.
    PUBLISH_FAILED = "publish_failed"
    #: The in-flight bound left no room for new rows (DESIGN invariant 16).
    IN_FLIGHT_BOUND = "in_flight_bound"
    #: A claim took fewer rows than it asked for: nothing more is due.
    DRAINED = "drained"
    #: The run's time budget ran out with batches still coming back full.
    BUDGET = "budget"
    #: A claim task piled up behind a run that had just drained; it claimed nothing.
    COALESCED = "coalesced"


@dataclass(slots=True)
class ClaimRun:
    """What one claim run did."""

    claimed: int = 0
    published: int = 0
    released: int = 0
    reaped: int = 0
    lost: int = 0
    unroutable: int = 0
    batches: int = 0
    in_flight_limit: int = 0
    skipped: bool = False
    seconds: float = 0.0
    #: Why the run ended (``None``: it has not).
    stopped_by: StoppedBy | None = None
    errors: list[str] = field(default_factory=list)
    #: Seconds until a claim can take more of an event type a limit or a RateLimited hold kept
    #: back; ``None``: nothing was kept back. The push listener claims again then.
    flow_wait: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form (the claim task's result)."""
        return {
            "claimed": self.claimed,
            "published": self.published,
            "released": self.released,
            "reaped": self.reaped,
            "lost": self.lost,
            "unroutable": self.unroutable,
            "batches": self.batches,
            "in_flight_limit": self.in_flight_limit,
            "skipped": self.skipped,
            "seconds": round(self.seconds, 4),
            "stopped_by": "" if self.stopped_by is None else str(self.stopped_by),
            "flow_wait": None if self.flow_wait is None else round(self.flow_wait, 4),
        }


def default_owner() -> str:
    """``host:pid``: who holds a lease, for humans only (never used for decisions)."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(slots=True)
class _TransactionRun:
    """How far a transactional run got: its handler called, its done written."""

    called: bool = False
    done: bool = False


class _Superseded(Exception):  # noqa: N818 - control flow inside the dispatcher only
    """A transactional run's fenced done changed nothing: roll its transaction back."""


# SQLSTATE class 40, transaction rollback: a deadlock (40P01) or a serialization failure
# (40001) between a transactional handler's transaction and another. Nothing was committed; the
# same run may well succeed a moment later.
_ROLLBACK_CLASS = "40"


# What a rolled-back run's last_error says when the handler raised psycopg.Rollback.
_RAISED_ROLLBACK = (
    "the transactional handler rolled back its transaction (psycopg.Rollback)" + NOTHING_COMMITTED
)


def _transaction_ended(conn: psycopg.Connection[Any]) -> str | None:
    """Why the handler's transaction can no longer commit its done, read from libpq's state
    (no round trip); ``None`` while it is open and healthy."""
    status = conn.info.transaction_status
    if status == pq.TransactionStatus.IDLE:
        return (
            "the transactional handler ended its transaction itself (a COMMIT or ROLLBACK on its "
            "connection): its done was not written, what it wrote before may have committed"
        )
    if status == pq.TransactionStatus.INERROR:
        return (
            "a statement failed in the transactional handler's transaction and the handler went "
            f"on: the transaction could only roll back{NOTHING_COMMITTED}"
        )
    return None


def _transaction_conflict(exc: BaseException) -> psycopg.Error | None:
    """The psycopg error of class 40 behind ``exc`` (Django and SQLAlchemy wrap it), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, psycopg.Error):
            state = current.sqlstate or ""
            return current if state.startswith(_ROLLBACK_CLASS) else None
        orig = getattr(current, "orig", None)  # SQLAlchemy's DBAPIError
        current = orig if isinstance(orig, BaseException) else current.__cause__
    return None


class InFlightBound:
    """The in-flight bound of a process's claim runs (DESIGN invariant 16), computed at most
    every :data:`BOUND_REFRESH` seconds: rows finished in the last lease, halved, clamped to
    ``[min_in_flight, max_in_flight]``; ``max_in_flight`` when ``adaptive_in_flight`` is off."""

    def __init__(self, config: OutboxConfig, store: Store) -> None:
        self.config = config
        self.store = store
        # The bound and when (monotonic) it was computed.
        self._bound: tuple[float, int] | None = None

    def __call__(self, conn: psycopg.Connection[Any]) -> int:
        """Claimed-but-unfinished rows allowed now."""
        cfg = self.config
        if not cfg.adaptive_in_flight:
            return cfg.max_in_flight
        now = time.monotonic()
        cached = self._bound
        if cached is not None and 0 <= now - cached[0] < BOUND_REFRESH:
            # Push runs claims back to back, one per producer commit: a count over the last
            # lease's finished rows changes little within a second, so it is reused.
            return cached[1]
        floor = cfg.effective_min_in_flight
        # Rows finished in the last lease, halved: what was handed out can start within half a
        # lease at the throughput the workers just showed.
        recent = self.store.recent_done(conn, window=cfg.lease, cap=2 * cfg.max_in_flight)
        limit = max(floor, min(cfg.max_in_flight, recent // 2))
        self._bound = (now, limit)
        return limit


class Dispatcher(BatchDelivery, SlotWake):
    """Claim/publish and deliver/finalize for one outbox table.

    :param config: the outbox settings.
    :param connection: returns a context manager yielding an autocommit connection (a pool's
        ``connection``).
    :param handlers: event type -> :class:`HandlerSpec`; the claim only takes event types that
        have a handler here (others stay pending and are reported as unroutable).
    :param store: the SQL layer (default: a :class:`~outbox_celery.store.Store` on ``table``).
    :param retry: the wait after a retryable failure that carries no delay of its own
        (default: :class:`~outbox_celery.backoff.Backoff` from ``backoff_base``/``backoff_cap``).
    :param recover: called before a fenced write is retried after a broken connection (the
        :class:`~outbox_celery.celery_app.Outbox` checks its pool's idle connections there).
    """

    handlers: Mapping[str, HandlerSpec]

    def __init__(
        self,
        config: OutboxConfig,
        connection: ConnectionSource,
        handlers: dict[str, HandlerSpec],
        *,
        store: Store | None = None,
        retry: RetryPolicy | None = None,
        recover: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self._recover = recover
        self.connection = connection
        self.handlers = handlers
        self.store = store or Store(config.table, relaxed_commit=config.relaxed_commit)
        self._retry = retry
        self.backoff = Backoff(config.backoff_base, config.backoff_cap)
        self._in_flight = InFlightBound(config, self.store)
        #: Where this process's claims start their index scans (DESIGN invariant 18).
        self.marks = ScanMarks(lookback=config.scan_lookback, full_every=config.full_scan_interval)
        #: Batched ``done`` writes of this process (``done_batch_delay``; None when 0).
        self.done_batch: DoneBatcher | None = None
        if config.done_batch_delay > 0:
            self.done_batch = DoneBatcher(self._write_done_batch, delay=config.done_batch_delay)
        #: The concurrency-limited types the last claim left at their limit, and when this
        #: process read that (monotonic; read again after AT_CAP_TTL).
        self._capped: tuple[float, frozenset[str]] = (-math.inf, frozenset())

    @property
    def retry(self) -> RetryPolicy:
        """The wait after a retryable failure that carries no delay: ``retry=`` or the backoff."""
        return self._retry or self.backoff

    # -- claim side ----------------------------------------------------------------------------

    def in_flight_limit(self, conn: psycopg.Connection[Any]) -> int:
        """Claimed-but-unfinished rows allowed now (DESIGN invariant 16)."""
        return self._in_flight(conn)

    def claim_and_publish(self, publish: Publisher, *, owner: str | None = None) -> ClaimRun:
        """One claim run: claim batches while they come back full, within the time budget.

        Each batch is claimed and committed first, then published; rows that could not be
        published are released at once (no attempt spent, no lease to wait out).
        """
        cfg = self.config
        run = ClaimRun()
        started = time.monotonic()
        deadline = started + cfg.effective_claim_budget
        owner = owner or default_owner()
        event_types = sorted(self.handlers)
        if not event_types:
            logger.warning("outbox claim: no handlers registered, nothing to claim")
            run.stopped_by = StoppedBy.NO_HANDLERS
            return run
        # The claim lock lives in a transaction held open on a connection of its own for the
        # whole run (the claims commit on the other); its end releases the lock. Taken first, so
        # a run that loses the race never holds a second pooled connection.
        with self.connection() as lock_conn, lock_conn.transaction():
            if not self.store.try_claim_lock(lock_conn):
                run.skipped = True
                run.stopped_by = StoppedBy.ANOTHER_CLAIM_RUNNING
                return run
            with self.connection() as conn:
                self._claim_loop(conn, publish, run, owner, event_types, deadline)
        run.seconds = time.monotonic() - started
        if run.claimed or run.reaped or run.released or run.lost or run.unroutable:
            logger.info(
                "outbox claim run: claimed=%s published=%s released=%s reaped=%s in %.3fs",
                run.claimed,
                run.published,
                run.released,
                run.reaped,
                run.seconds,
                extra={"outcome": "claim_run", **run.as_dict()},
            )
        return run

    def _claim_loop(
        self,
        conn: psycopg.Connection[Any],
        publish: Publisher,
        run: ClaimRun,
        owner: str,
        event_types: list[str],
        deadline: float,
    ) -> None:
        cfg = self.config
        run.in_flight_limit = limit = self.in_flight_limit(conn)
        # Counted once per run, then raised by what the run claims: an over-estimate (rows that
        # finish meanwhile are not subtracted), so the bound holds. The count steps over the dead
        # versions of every lease of the last lease period, so it is not repeated per batch.
        in_flight = self.store.in_flight(conn)
        limits = {t: spec.limit for t, spec in self.handlers.items() if spec.limit is not None}
        # Batch handlers that let a batch fill (max_wait). Capped at scan_lookback: a row
        # held back longer could fall behind the scan marks (DESIGN invariant 18).
        fill = {
            t: (spec.batch, min(spec.max_wait, cfg.scan_lookback))
            for t, spec in self.handlers.items()
            if spec.batch and spec.max_wait > 0
        }
        while True:
            room = limit - in_flight
            # A full bound stops new claims only: the reap and the re-claim of expired leases
            # run anyway, or lost tasks would hold the outbox still (DESIGN invariant 16).
            want = max(0, min(cfg.batch_size, room))
            result = self.store.claim(
                conn,
                limit=want,
                lease=cfg.lease,
                owner=owner,
                max_attempts=cfg.max_attempts,
                event_types=event_types,
                expired_limit=cfg.batch_size,
                unroutable_delay=cfg.unroutable_delay,
                marks=self.marks,
                limits=limits,
                fill=fill,
            )
            if result.flow_wait is not None:
                run.flow_wait = min(run.flow_wait or result.flow_wait, result.flow_wait)
            in_flight += len(result.claimed)
            run.batches += 1
            run.reaped += result.reaped
            run.lost += result.lost
            run.unroutable += result.unroutable
            run.claimed += len(result.claimed)
            if result.claimed and not self._publish(conn, publish, run, result.claimed):
                return
            if want == 0:
                run.stopped_by = StoppedBy.IN_FLIGHT_BOUND
                return
            if len(result.claimed) < want:
                run.stopped_by = StoppedBy.DRAINED
                return
            if time.monotonic() >= deadline:
                run.stopped_by = StoppedBy.BUDGET
                return

    def _publish(
        self, conn: psycopg.Connection[Any], publish: Publisher, run: ClaimRun, claims: Sequence[Claimed]
    ) -> bool:
        """Publish one claim's rows; give back what was not sent (then False: the run stops)."""
        # Grouped as the delivery tasks will carry them (batch handlers, invariant 21): the rows after a
        # failed publish are then exactly those that were not sent.
        units = publish_units(claims, self.handlers, max_attempts=self.config.max_attempts)
        claimed = [c for unit in units for c in unit]
        published = 0
        try:
            published = publish(claimed)
        except Exception as exc:  # the publisher should not raise; be safe anyway
            logger.exception("outbox publish failed")
            run.errors.append(repr(exc))
        run.published += published
        unpublished = claimed[published:]
        if not unpublished:
            return True
        run.released += self.store.release(conn, unpublished)
        run.stopped_by = StoppedBy.PUBLISH_FAILED
        logger.error(
            "outbox publish failed: %s claimed row(s) given back to pending",
            len(unpublished),
            extra={"outcome": "released", "released": len(unpublished)},
        )
        return False

    # -- worker side ---------------------------------------------------------------------------

    def deliver(self, outbox_id: int, lease_version: int, *, batch_done: bool = False) -> Outcome:
        """Fenced start, handler outside any transaction, classification, fenced finalize.

        Returns the :class:`~outbox_celery.message.Outcome`. An unexpected handler exception is
        recorded in ``last_error`` and re-raised (the row comes back through its lease).

        :param batch_done: let an unordered message's ``done`` wait up to ``done_batch_delay``
            to be written with others (the delivery task does; see ``_done_batch``). The
            outcome is then ``done`` before the row says so.
        """
        # The start gives the row at least one lease from now on the database's clock; its end
        # is tracked on this process's monotonic clock, a duration, never a wall time.
        lease_end = time.monotonic() + self.config.lease
        log: dict[str, Any] = {"outbox_id": outbox_id, "lease_version": lease_version}
        msg = self._start(outbox_id, lease_version, log)
        if msg is None:
            return Outcome.STALE
        log.update(event_type=msg.route, attempt=msg.attempts)
        spec = self.handlers.get(msg.route)
        if spec is None:
            return self._unroutable(msg, lease_version, log)
        if spec.batch is not None:
            # A batch handler's event type delivered by a one-row task (sent before a deploy
            # that added batch=): a batch of one.
            return self._run_batch(spec, [msg], log)[msg.id]
        return self._deliver_started(spec, msg, log, lease_end, batch_done=batch_done)

    def _deliver_started(
        self, spec: HandlerSpec, msg: Message, log: dict[str, Any], lease_end: float, *, batch_done: bool
    ) -> Outcome:
        """A started message's handler, classification and fenced finalize (a one-row task's,
        or one of a pack's, invariant 30); ``lease_end`` is its lease's end on this process's
        monotonic clock. An unclassified handler exception is recorded and re-raised."""
        lease_version = msg.lease_version
        msg = replace(msg, _extend=self._extender(msg.id, lease_version))
        started = time.monotonic()
        if spec.transaction is not None:
            outcome = self._deliver_in_transaction(spec, spec.transaction, msg, lease_version, log, started)
            if outcome is Outcome.DONE and self._wakes_claim(spec):
                self._wake()  # its done committed with the handler's transaction: a slot is free
            return outcome
        verdict = self._run_handler(spec, msg, log, started)
        batchable = batch_done and verdict.outcome is Outcome.DONE
        if self._wakes_claim(spec):
            outcome = self._finish_freeing_slot(verdict, msg, lease_version)
        elif batchable and self._batch_done(msg, lease_version, lease_end):
            outcome = Outcome.DONE
        else:
            outcome = self._finish(verdict, msg, lease_version)
        logger.info(
            "outbox id %s %s -> %s",
            msg.id,
            msg.route,
            outcome,
            extra={**log, "outcome": outcome, "duration_ms": _ms_since(started)},
        )
        return outcome

    def _start(self, outbox_id: int, lease_version: int, log: dict[str, Any]) -> Message | None:
        """The fenced start of one claim: its message, or ``None`` (stale or exhausted, logged).

        A failure of the start itself is recorded as the library's (:meth:`_failed_before_handler`)
        and re-raised.
        """
        try:
            started = self._begin("start", [Lease(outbox_id, lease_version)])
            msg = started[0] if started else None
        except Exception as exc:
            self._failed_before_handler(outbox_id, lease_version, exc, log)
            raise
        if msg is None:
            logger.info(
                "outbox id %s version %s is stale or exhausted; handler not called",
                outbox_id,
                lease_version,
                extra={**log, "outcome": Outcome.STALE},
            )
        return msg

    def _begin(self, op: str, leases: list[Lease]) -> list[Message]:
        """The fenced start of one lease or many (the completer's), retried once on a broken
        connection: the started messages, sorted by id."""
        cfg = self.config
        # One token for the start and its retry: a retry after a lost reply gets its own start
        # back uncounted, while any other start of these claims is refused.
        starter = starter_token()
        return self._fenced_write(
            op,
            leases[0].id,
            leases[0].lease_version,
            lambda conn: self.store.completer.start(
                conn, leases, lease=cfg.lease, max_attempts=cfg.max_attempts, starter=starter
            ),
        )

    def _run_handler(self, spec: HandlerSpec, msg: Message, log: dict[str, Any], started: float) -> Verdict:
        """Call a plain handler outside any transaction; the verdict of what it did.

        An exception the handler does not classify is recorded and re-raised: Celery reports a
        failure and the row comes back through its lease, never a silent "transient" retry.
        """
        try:
            # The lease heartbeat is a no-op unless configured; the span continues the producer's
            # trace when it had one (tracing.py).
            with lease_heartbeat(self.config, msg.extend_lease, log=log), handler_span(msg):
                spec.fn(msg)
        except BaseException as exc:
            verdict = classify(exc, msg.attempts, self.retry)
            if verdict is None:
                self._record_error(msg.id, msg.lease_version, _error_text(exc))
                logger.error(
                    "outbox id %s handler raised %s; row returns after its lease",
                    msg.id,
                    type(exc).__name__,
                    extra={**log, "outcome": Outcome.ERROR, "duration_ms": _ms_since(started)},
                )
                raise
            return verdict
        return Verdict(Outcome.DONE)

    def _deliver_in_transaction(
        self,
        spec: HandlerSpec,
        kind: TransactionKind,
        msg: Message,
        lease_version: int,
        log: dict[str, Any],
        started: float,
    ) -> Outcome:
        """A transactional handler: its writes and the fenced done commit together (invariant 20).

        A failure before the handler is called (opening or bounding the transaction) is the
        library's, recorded as such. The transaction is bounded by ``task_time_limit``
        (``Store.limit_transaction``); the
        done is its last statement and durable (never batched, never relaxed: it commits the
        handler's effect). A done that loses the fence raises inside the transaction, which
        rolls the effect back. Any exception rolls back too; its outcome is then recorded in a
        separate fenced statement, as for a plain handler.
        """
        run = _TransactionRun()
        try:
            self._run_in_transaction(spec, kind, msg, log, run)
        except _Superseded:
            outcome = Outcome.LOST_LEASE
        except BaseException as exc:
            if not run.called and isinstance(exc, Exception):
                # The transaction could not be opened or bounded (or an ordered message met
                # another isolation level): the library's failure, not the handler's.
                self._failed_before_handler(msg.id, lease_version, exc, log)
                raise
            outcome = self._transaction_failed(exc, msg, lease_version, log, started)
        else:
            if run.done:
                outcome = Outcome.DONE
            else:
                # The block ended without an exception and without the done: the handler raised
                # psycopg.Rollback, which the psycopg transaction swallows after rolling back.
                rolled_back = self._rolled_back(msg, _RAISED_ROLLBACK, log)
                verdict = classify(rolled_back, msg.attempts, self.retry)
                assert verdict is not None
                outcome = self._finish(verdict, msg, lease_version)
        logger.info(
            "outbox id %s %s -> %s",
            msg.id,
            msg.route,
            outcome,
            extra={**log, "outcome": outcome, "transactional": kind.name, "duration_ms": _ms_since(started)},
        )
        return outcome

    def _run_in_transaction(
        self,
        spec: HandlerSpec,
        kind: TransactionKind,
        msg: Message,
        log: dict[str, Any],
        run: _TransactionRun,
    ) -> None:
        """The transaction of a transactional handler: bounded, the handler, its follow-ups moved
        to its commit when it ran long, the fenced done last (``run`` says how far it got)."""
        cfg = self.config
        with (
            lease_heartbeat(cfg, msg.extend_lease, log=log),
            handler_span(msg),
            kind.begin(self.connection) as (handle, conn),
        ):
            isolation = self.store.limit_transaction(conn, seconds=cfg.task_time_limit)
            if msg.ordering_key is not None and isolation != "read committed":
                # The ordered done decides the key's next head from its statement's
                # snapshot, taken after the key lock only under read committed.
                raise ConfigurationError(
                    f"ordered messages need a READ COMMITTED transaction, the {kind.name} "
                    f"transactional handler of {msg.event_type!r} runs in {isolation}"
                )
            run.called = True
            began = time.monotonic()
            with FOLLOW_UPS.watch(conn) as follow_ups:
                spec.fn(msg, handle)
            ended = _transaction_ended(conn)
            if ended is not None:
                raise TransactionRolledBack(ended)
            if follow_ups and time.monotonic() - began >= cfg.scan_lookback / 2:
                # A long transaction: its follow-ups would commit behind the claims' scan
                # marks, at its start; they move to its commit (invariant 18).
                self._follow_ups_at_commit(conn, follow_ups)
            finish = Verdict(Outcome.DONE).finish(msg, msg.lease_version)
            if not self._complete("finish_done", [finish], conn=conn).of(msg.id).applied:
                raise _Superseded
            run.done = True

    def _transaction_failed(
        self, exc: BaseException, msg: Message, lease_version: int, log: dict[str, Any], started: float
    ) -> Outcome:
        """A transactional run that raised (its transaction rolled back): its outcome, written in
        a fenced statement of its own; an unclassified exception is recorded and re-raised."""
        conflict = _transaction_conflict(exc)
        if conflict is not None:
            exc = RetryableError(f"transaction conflict ({conflict.sqlstate}): {conflict}")
        elif isinstance(exc, TransactionRolledBack):
            exc = self._rolled_back(msg, str(exc), log)
        elif isinstance(exc, psycopg.Rollback):
            # Raised where no psycopg transaction() swallows it (the SQLAlchemy and Django
            # kinds): the transaction rolls back all the same.
            exc = self._rolled_back(msg, _RAISED_ROLLBACK, log)
        verdict = classify(exc, msg.attempts, self.retry)
        if verdict is None:
            self._record_error(msg.id, lease_version, _error_text(exc))
            logger.error(
                "outbox id %s transactional handler raised %s; rolled back, row returns after its lease",
                msg.id,
                type(exc).__name__,
                extra={**log, "outcome": Outcome.ERROR, "duration_ms": _ms_since(started)},
            )
            raise exc
        return self._finish(verdict, msg, lease_version)

    def _rolled_back(self, msg: Message, why: str, log: dict[str, Any]) -> RetryableError:
        """The retryable failure of a transactional run that returned but did not commit.

        Its done did not commit, ``why`` says why in ``last_error``; the row is back
        after a backoff with the attempt kept (``dead`` at ``max_attempts``, so a handler that
        always rolls back ends), never left to its lease (invariant 20).
        """
        logger.warning("outbox id %s: %s; retried after a backoff", msg.id, why, extra=log)
        return RetryableError(why)

    def _follow_ups_at_commit(self, conn: psycopg.Connection[Any], follow_ups: Noted) -> None:
        """Move a long transaction's follow-ups, table by table, to the time of its commit."""
        for table, ids in follow_ups.items():
            store = self.store if table == self.store.table else Store(table)
            store.follow_ups_at_commit(conn, ids)

    def _extend(self, leases: list[Lease], seconds: float) -> bool:
        """The lease heartbeat of a delivery or a batch: true while any row of it holds its lease."""
        with self.connection() as conn:
            return bool(self.store.completer.extend(conn, leases, seconds=seconds))

    def _batch_done(self, msg: Message, lease_version: int, lease_end: float) -> bool:
        """Queue the done of an unordered row of no group (invariant 29) for the next batch."""
        batch = self.done_batch
        if batch is None or msg.ordering_key is not None or msg.group_id is not None:
            return False
        if lease_end - time.monotonic() <= batch.delay + DONE_BATCH_MARGIN:
            return False
        batch.add(msg.id, lease_version)
        return True

    def _write_done_batch(self, finished: list[Lease]) -> FinalizedMany:
        return self._complete("done_many", [Finish(x, Step.DONE, grouped=False) for x in finished])

    def flush(self) -> None:
        """Write the ``done`` of every handled message this process still holds."""
        if self.done_batch is not None:
            self.done_batch.close()

    def _unroutable(self, msg: Message, lease_version: int, log: dict[str, Any]) -> Outcome:
        """No handler for this event type in this worker: postpone, attempt refunded."""
        delay = self.config.unroutable_delay
        why = f"unroutable: no handler for event type {msg.route!r} in this worker"
        self._complete(
            "postpone", [Verdict(Outcome.UNROUTABLE, delay=delay, error=why).finish(msg, lease_version)]
        )
        logger.warning(
            "outbox id %s: no handler for %r here; postponed %.0fs",
            msg.id,
            msg.route,
            delay,
            extra={**log, "outcome": Outcome.UNROUTABLE},
        )
        return Outcome.UNROUTABLE

    def _failed_before_handler(
        self, outbox_id: int, lease_version: int, exc: Exception, log: dict[str, Any]
    ) -> None:
        """The library's own code failed between the claim and the handler: say so at once.

        Left alone, the row would sit ``processing`` until its lease ran out with an empty
        ``last_error``, be claimed again and again, and finally be reaped as if its worker had
        been lost. Instead the failure is written now, fenced, as a retryable one: back to
        ``pending`` after a short backoff with the attempt kept (the start may have counted
        it), ``dead`` once attempts are exhausted, ``last_error`` naming the library, not the
        handler, as the culprit. When even that write fails (the database is unreachable), the
        row comes back through its lease.
        """
        try:
            self._complete("finish_retry", [self._pre_handler_failure(Lease(outbox_id, lease_version), exc)])
        except Exception:
            logger.exception(
                "outbox id %s: could not record the failure before the handler", outbox_id, extra=log
            )
        logger.error(
            "outbox id %s: outbox-celery failed before calling the handler (%s: %s); the handler "
            "did not run, the message is retried after a backoff",
            outbox_id,
            type(exc).__name__,
            exc,
            extra={**log, "outcome": Outcome.ERROR},
        )

    def _pre_handler_failure(self, lease: Lease, exc: Exception) -> Finish:
        """The retry that records a failure of the library's own code before the handler."""
        error = f"{PRE_HANDLER_FAILURE}: {_error_text(exc)}"[:4000]
        return Finish(lease, Step.RETRY, self.backoff.delay(1), error)

    def _record_error(self, outbox_id: int, lease_version: int, error: str) -> None:
        """Keep an unclassified error; the row comes back through its lease."""
        self._complete("record_error", [Finish(Lease(outbox_id, lease_version), Step.ERROR, error=error)])

    def _complete(
        self,
        op: str,
        finishes: Sequence[Finish],
        *,
        notify: bool = False,
        conn: psycopg.Connection[Any] | None = None,
    ) -> FinalizedMany:
        """Every finalize of a delivery: the completer's one fenced statement (complete.py).

        On its own connection, retried once when the server broke it (:meth:`_fenced_write`);
        with ``conn`` as the last statements of that connection's open transaction (a
        transactional handler's, invariant 20), which commits or rolls back as a whole.
        """
        cfg = self.config

        def write(c: psycopg.Connection[Any]) -> FinalizedMany:
            return self.store.completer.finish(
                c,
                finishes,
                max_attempts=cfg.max_attempts,
                max_age=cfg.max_defer_age,
                notify=notify,
                joined=conn is not None,
            )

        if conn is not None:
            return write(conn)
        first = finishes[0].lease
        return self._fenced_write(op, first.id, first.lease_version, write)

    def _fenced_write(
        self, op: str, outbox_id: int, lease_version: int, write: Callable[[psycopg.Connection[Any]], T]
    ) -> T:
        """Run one fenced write; on a connection the server broke, once more on a checked one.

        A pooled connection may have been closed by the server since its last use (a restart,
        a failover, ``pg_terminate_backend``); recently used ones are not checked before use
        (IdleCheck). Retrying is safe: the write is fenced on the claim's ``lease_version`` and
        status, so whichever run lands first wins and a second changes nothing (DESIGN
        invariant 4); a start whose reply was lost after its commit is found again by its token
        and counts nothing more. Without the retry a finalize would be lost until the
        lease ends, and the message delivered again.
        """
        try:
            with self.connection() as conn:
                return write(conn)
        except psycopg.OperationalError as exc:
            logger.warning(
                "outbox id %s: %s failed on a broken connection (%s); retrying once on a fresh one",
                outbox_id,
                op,
                first_line(exc),
                extra={"outbox_id": outbox_id, "lease_version": lease_version, "operation": op},
            )
        if self._recover is not None:
            self._recover()
        with self.connection() as conn:
            return write(conn)

    def _finish(self, verdict: Verdict, msg: Message, lease_version: int) -> Outcome:
        """The verdict's fenced write; :attr:`Outcome.LOST_LEASE` when another claim won."""
        won = self._complete(str(verdict.outcome), [verdict.finish(msg, lease_version)])
        return _outcome_of(verdict, won.of(msg.id))
