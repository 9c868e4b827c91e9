"""The Claimer: one claim run of a table, from the claim lock to the published tasks.

A run claims batches through the executor (:mod:`outbox_celery.claim.executor`) while they come
back full, each in a transaction that takes the table's claim lock first and then counts what
is in flight against the bound (DESIGN invariant 16), and hands each batch to a ``publish``
callable, cut into the tasks that carry it (:func:`~outbox_celery.claim.units.publish_units`);
rows the broker did not take go back to ``pending`` at once (invariant 12). No Celery here: the
Outbox passes its publisher in.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import psycopg

from ..config import OutboxConfig
from ..db.store import Store
from ..handlers import HandlerSpec
from . import executor
from .executor import Claimed, ScanMarks
from .units import publish_units

__all__ = ["BOUND_REFRESH", "ClaimRun", "Claimer", "InFlightBound", "Publisher", "StoppedBy", "default_owner"]

logger = logging.getLogger(__name__)

# Seconds an adaptive in-flight bound is reused by later claim runs of the same process: it
# follows throughput over a whole lease, so recounting it for every run adds statements, not
# precision. Only the bound is reused; the rows in flight are counted on every run.
BOUND_REFRESH = 1.0
# With several databases, a pushed database's in-flight bound is what it can start within
# SHARED_AHEAD seconds at the throughput of the last SHARED_MEASURE seconds (DESIGN invariant
# 37): every database's tasks share the delivery queue, and what one keeps there the others'
# next tasks wait behind.
SHARED_AHEAD = 2.0
SHARED_MEASURE = 10.0


@dataclass(frozen=True, slots=True)
class Published:
    """What a publish did with a claim batch.

    :ivar sent: the claims whose task the broker took.
    :ivar refused: route -> why the app refused to route its tasks (a queue that is not
        declared while ``task_create_missing_queues`` is off): a fault of that route alone; its
        claims were skipped and the rest of the batch published.

    A claim in neither was not sent because the broker failed: the publish stopped there.
    """

    sent: Sequence[Claimed]
    refused: Mapping[str, str] = field(default_factory=dict)


class Publisher(Protocol):
    """Hands claimed rows to the broker: a :class:`Published`, or how many were published, in
    order (a prefix: it stopped at the first failure; the rows after it are given back)."""

    def __call__(self, claims: Sequence[Claimed]) -> Published | int: ...


class Connections(Protocol):
    """Where the claimer's connections come from (a pool's ``connection``)."""

    def __call__(self) -> AbstractContextManager[psycopg.Connection[Any]]: ...


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
    #: Claims whose route's tasks the app refused to route (an undeclared queue): given back
    #: and that route left out of this process's claims for ``unroutable_delay``.
    refused: int = 0
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
            "refused": self.refused,
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


class InFlightBound:
    """The in-flight bound of a process's claim runs (DESIGN invariant 16), computed at most
    every :data:`BOUND_REFRESH` seconds: rows finished in the last lease, halved, clamped to
    ``[min_in_flight, max_in_flight]``; ``max_in_flight`` when ``adaptive_in_flight`` is off.

    ``shared``: the table is one of several databases whose tasks share the delivery queue.
    While its claims are pushed (``listen``), its bound is what it finished in the last
    :data:`SHARED_MEASURE` seconds, scaled to :data:`SHARED_AHEAD` (DESIGN invariant 37).
    """

    def __init__(self, config: OutboxConfig, store: Store, *, shared: bool = False) -> None:
        self.config = config
        self.store = store
        # Finished rows counted over this many seconds, and the share of them allowed in flight.
        if shared and config.listen:
            self._window, self._share = SHARED_MEASURE, SHARED_AHEAD / SHARED_MEASURE
        else:
            self._window, self._share = config.lease, 0.5
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
        # lease at the throughput the workers just showed (shared: within SHARED_AHEAD).
        cap = int(cfg.max_in_flight / self._share) + 1
        recent = self.store.recent_done(conn, window=self._window, cap=cap)
        limit = max(floor, min(cfg.max_in_flight, int(recent * self._share)))
        self._bound = (now, limit)
        return limit


class Claimer:
    """Claim runs of one outbox table.

    :param config: the outbox settings.
    :param connection: returns a context manager yielding an autocommit connection (a pool's
        ``connection``).
    :param handlers: route -> :class:`~outbox_celery.handlers.HandlerSpec`; the claim takes
        only routes that have a handler here (others stay pending, counted unroutable).
    :param store: the table's statements (default: a :class:`~outbox_celery.db.store.Store`).
    :param shared: the table is one of several databases' (:class:`InFlightBound`).
    """

    def __init__(
        self,
        config: OutboxConfig,
        connection: Connections,
        handlers: Mapping[str, HandlerSpec],
        *,
        store: Store | None = None,
        shared: bool = False,
    ) -> None:
        self.config = config
        self.connection = connection
        self.handlers = handlers
        self.store = store or Store(config.table, relaxed_commit=config.relaxed_commit)
        self._in_flight = InFlightBound(config, self.store, shared=shared)
        #: Where this process's claims start their index scans (DESIGN invariant 18).
        self.marks = ScanMarks(lookback=config.scan_lookback, full_every=config.full_scan_interval)
        #: Routes whose tasks the app refused to route, and until when (monotonic) this
        #: process's claims leave them out.
        self._refused: dict[str, float] = {}
        #: The routes the last run found stalled (DESIGN invariant 16).
        self._stalled: frozenset[str] = frozenset()

    def in_flight_limit(self, conn: psycopg.Connection[Any]) -> int:
        """Claimed-but-unfinished rows allowed now (DESIGN invariant 16)."""
        return self._in_flight(conn)

    def run(self, publish: Publisher, *, owner: str | None = None) -> ClaimRun:
        """One claim run: claim batches while they come back full, within the time budget.

        Each batch is claimed and committed first, then published; rows that could not be
        published are released at once (no attempt spent, no lease to wait out).
        """
        cfg = self.config
        run = ClaimRun()
        started = time.monotonic()
        deadline = started + cfg.effective_claim_budget
        owner = owner or default_owner()
        routes = self._routes()
        if not routes:
            if self.handlers:
                logger.warning(
                    "outbox claim%s: every route's tasks were refused lately, nothing to claim",
                    self.store.on,
                    extra=self.store.log_fields,
                )
            else:
                logger.warning(
                    "outbox claim%s: no handlers registered, nothing to claim",
                    self.store.on,
                    extra=self.store.log_fields,
                )
            run.stopped_by = StoppedBy.NO_HANDLERS
            return run
        with self.connection() as conn:
            self._loop(conn, publish, run, owner, routes, deadline)
        if run.skipped:
            return run
        run.seconds = time.monotonic() - started
        if run.claimed or run.reaped or run.released or run.lost or run.unroutable:
            logger.info(
                "outbox claim run%s: claimed=%s published=%s released=%s reaped=%s in %.3fs",
                self.store.on,
                run.claimed,
                run.published,
                run.released,
                run.reaped,
                run.seconds,
                extra={"outcome": "claim_run", **run.as_dict(), **self.store.log_fields},
            )
        return run

    def _live(self, conn: psycopg.Connection[Any]) -> tuple[int, frozenset[str]]:
        """Live leases counted against the bound, and the stalled routes (DESIGN invariant 16):
        a route whose oldest waiting task was claimed over ``stalled_after`` seconds ago has no
        worker starting its tasks; they are left out of the count, and the route out of new
        claims, so one route nobody consumes never slows another."""
        cfg = self.config
        routes = self.store.in_flight_by_route(conn, lease=cfg.lease, stall=cfg.stalled_after)
        stalled = frozenset(r.event_type for r in routes if r.stalled)
        for route in sorted(stalled - self._stalled):
            logger.warning(
                "outbox%s: no worker has started a task of %r for %.0fs (does its queue have a "
                "consumer?): no new rows of it are claimed until one starts; the other routes go on",
                self.store.on,
                route,
                cfg.stalled_after,
                extra={"outcome": "stalled", "event_type": route, **self.store.log_fields},
            )
        for route in sorted(self._stalled - stalled):
            logger.info(
                "outbox%s: tasks of %r are being started again",
                self.store.on,
                route,
                extra={"event_type": route, **self.store.log_fields},
            )
        self._stalled = stalled
        in_flight = sum(r.live - (r.unstarted if r.event_type in stalled else 0) for r in routes)
        return in_flight, stalled

    def _routes(self) -> list[str]:
        """The routes this run claims: every handler's, less those whose tasks were refused
        within the last ``unroutable_delay`` (their rows wait in ``pending``)."""
        now = time.monotonic()
        self._refused = {r: until for r, until in self._refused.items() if until > now}
        return sorted(set(self.handlers) - set(self._refused))

    def _loop(
        self,
        conn: psycopg.Connection[Any],
        publish: Publisher,
        run: ClaimRun,
        owner: str,
        routes: list[str],
        deadline: float,
    ) -> None:
        cfg = self.config
        run.in_flight_limit = limit = self.in_flight_limit(conn)

        def room(claiming: psycopg.Connection[Any]) -> tuple[int, frozenset[str]]:
            # In each claim transaction, after its claim lock: every claim committed before it
            # is counted, so the bound holds across runs and processes. A stalled route (no
            # worker starts its tasks) gets no new rows, and its waiting tasks take no room from
            # the others. A full bound stops new claims only: the reap and the re-claim of
            # expired leases run anyway, or lost tasks would hold the outbox still.
            in_flight, hold = self._live(claiming)
            return max(0, min(cfg.batch_size, limit - in_flight)), hold

        limits = {t: spec.limit for t, spec in self.handlers.items() if spec.limit is not None}
        # Batch handlers that let a batch fill (max_wait). Capped at scan_lookback: a row
        # held back longer could fall behind the scan marks (DESIGN invariant 18).
        fill = {
            t: (spec.batch, min(spec.max_wait, cfg.scan_lookback))
            for t, spec in self.handlers.items()
            if spec.batch and spec.max_wait > 0
        }
        while True:
            result = executor.claim(
                self.store,
                conn,
                limit=0,
                lease=cfg.lease,
                owner=owner,
                max_attempts=cfg.max_attempts,
                event_types=routes,
                expired_limit=cfg.batch_size,
                unroutable_delay=cfg.unroutable_delay,
                marks=self.marks,
                limits=limits,
                fill=fill,
                lock=True,
                room=room,
            )
            if not result.locked:
                # Another run's claim transaction holds the lock: it claims what is due.
                run.skipped = not run.batches
                run.stopped_by = StoppedBy.ANOTHER_CLAIM_RUNNING
                return
            want = result.limit
            if result.flow_wait is not None:
                run.flow_wait = min(run.flow_wait or result.flow_wait, result.flow_wait)
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
        """Publish one claim's rows; give back what was not sent (False: the broker failed and
        the run stops; a route the app refused to route does not stop it, invariant 12)."""
        # Grouped as the delivery tasks will carry them (invariants 21, 30): the rows after a
        # failed publish are then exactly those that were not sent.
        units = publish_units(claims, self.handlers, max_attempts=self.config.max_attempts)
        claimed = [c for unit in units for c in unit]
        result: Published | int = 0
        try:
            result = publish(claimed)
        except Exception as exc:  # the publisher should not raise; be safe anyway
            logger.exception("outbox publish failed")
            run.errors.append(repr(exc))
        if isinstance(result, int):
            result = Published(claimed[:result])
        sent = {c.id for c in result.sent}
        run.published += len(sent)
        refused = [c for c in claimed if c.id not in sent and c.event_type in result.refused]
        failed = [c for c in claimed if c.id not in sent and c.event_type not in result.refused]
        if refused:
            self._refuse(run, refused, result.refused)
        if failed:
            run.stopped_by = StoppedBy.PUBLISH_FAILED
            logger.error(
                "outbox publish failed%s: %s claimed row(s) given back to pending",
                self.store.on,
                len(failed),
                extra={"outcome": "released", "released": len(failed), **self.store.log_fields},
            )
        if refused or failed:
            run.released += self.store.release(conn, [c.lease for c in refused + failed])
        return not failed

    def _refuse(self, run: ClaimRun, claims: list[Claimed], why: Mapping[str, str]) -> None:
        """Leave the refused routes out of this process's claims for ``unroutable_delay``."""
        delay = self.config.unroutable_delay
        run.refused += len(claims)
        for route in sorted({c.event_type for c in claims}):
            self._refused[route] = time.monotonic() + delay
            logger.error(
                "outbox%s: the app refused to route the tasks of %r (%s); its rows go back to pending "
                "and are not claimed by this process for %.0fs, the other routes are published",
                self.store.on,
                route,
                why[route],
                delay,
                extra={
                    "outcome": "refused",
                    "event_type": route,
                    "refused": why[route],
                    **self.store.log_fields,
                },
            )
