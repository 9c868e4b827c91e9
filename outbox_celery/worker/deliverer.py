"""The Deliverer: one delivery task of 1..N leases, from the fenced start to every fenced finish.

A task carries one lease, a batch handler's batch or a pack (invariants 21, 30); all three are
delivered by :meth:`Deliverer.deliver`: one fenced start for the task's leases, then per route
the batch handler once (:class:`~outbox_celery.worker.batch.BatchRun`) or each message's
handler in claim order, a transactional one in its own transaction
(:class:`~outbox_celery.worker.in_transaction.TransactionalRun`). Every write goes through
:class:`~outbox_celery.worker.fence.FencedWrites`. No SQL and no Celery here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..backoff import Backoff, RetryPolicy
from ..config import OutboxConfig
from ..db.completer import START_KEEP, FinalizedMany, Finish, Lease, Step
from ..db.store import Store
from ..handlers import HandlerSpec
from ..message import Message, Outcome
from ..tracing import handler_span
from .batch import BatchRun
from .done_batch import DoneBatcher
from .fence import Connections, FencedWrites
from .heartbeat import lease_heartbeat
from .in_transaction import TransactionalRun
from .slot_wake import SlotWake
from .verdict import Verdict, classify, failed, ms_since, outcome_of

__all__ = ["DONE_BATCH_MARGIN", "PACK_SHARE", "Deliverer", "tally"]

logger = logging.getLogger(__name__)

# Seconds of lease a handled message must have left, beyond done_batch_delay, for its done to
# wait for a batch; with less the done is written at once, so it lands inside the lease.
DONE_BATCH_MARGIN = 1.0

#: The share of a lease within which a task of several one-message rows (a pack) may start its
#: next handler (invariant 30): past it, the rows it has not run go back to pending at once, so a
#: handler starts with at least ``1 - PACK_SHARE`` of a lease ahead of it and a slow handler
#: delays its neighbours by at most that much before they are claimed again.
PACK_SHARE = 0.1


def tally(outcomes: Mapping[int, Outcome]) -> dict[str, int]:
    """How many rows of a task ended in each outcome (a batch or pack task's result)."""
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[str(outcome)] = counts.get(str(outcome), 0) + 1
    return counts


class Deliverer:
    """Delivery tasks of one outbox table, in one worker process.

    :param config: the outbox settings.
    :param connection: returns a context manager yielding an autocommit connection (a pool's
        ``connection``).
    :param handlers: route -> :class:`~outbox_celery.handlers.HandlerSpec`.
    :param store: the table's statements (default: a :class:`~outbox_celery.db.store.Store`).
    :param retry: the wait after a retryable failure that carries no delay of its own
        (default: :class:`~outbox_celery.backoff.Backoff` from ``backoff_base``/``backoff_cap``).
    :param recover: called before a fenced write is retried after a broken connection.
    """

    def __init__(
        self,
        config: OutboxConfig,
        connection: Connections,
        handlers: Mapping[str, HandlerSpec],
        *,
        store: Store | None = None,
        retry: RetryPolicy | None = None,
        recover: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.connection = connection
        self.handlers = handlers
        self.store = store or Store(config.table, relaxed_commit=config.relaxed_commit)
        self._retry = retry
        self.backoff = Backoff(config.backoff_base, config.backoff_cap)
        self.fence = FencedWrites(config, connection, self.store, recover=recover)
        #: Batched ``done`` writes of this process (``done_batch_delay``; None when 0).
        self.done_batch: DoneBatcher | None = None
        if config.done_batch_delay > 0:
            self.done_batch = DoneBatcher(self._write_done_batch, delay=config.done_batch_delay)
        self._batch = BatchRun(config, self.fence, lambda: self.retry)
        self._transactional = TransactionalRun(config, self.fence, self.store, lambda: self.retry)
        self._slots = SlotWake(config, connection, self.store, handlers)

    @property
    def retry(self) -> RetryPolicy:
        """The wait after a retryable failure that carries no delay: ``retry=`` or the backoff."""
        return self._retry or self.backoff

    def deliver(
        self, leases: Sequence[Lease | tuple[int, int]], *, batch_done: bool = False
    ) -> dict[int, Outcome]:
        """One delivery task: one fenced start for its leases, then every started message's
        handler and fenced finish; the :class:`~outbox_celery.message.Outcome` of each row.

        A lease the start does not take (a newer claim, a finished row, a claim started by
        another task, no attempt left) is ``stale`` and calls nothing. Per route: no handler
        here postpones the rows (``unroutable``, attempt refunded); a batch handler is called
        once with its messages; a one-message handler is called for each message in claim
        order, and past :data:`PACK_SHARE` of a lease no further handler starts: the rows left
        go back to pending at once, their attempt refunded (``handed_back``). An exception a
        handler raises and does not classify is recorded for its rows (which come back through
        their lease) and re-raised after the other rows ran.

        :param batch_done: let an unordered message's ``done`` wait up to ``done_batch_delay``
            to be written with others (the delivery tasks do; see ``done_batch``). The outcome
            is then ``done`` before the row says so.
        """
        unique = list(dict.fromkeys(Lease.of(p) for p in leases))
        if not unique:
            return {}
        # The start leaves each row at least START_KEEP of a lease from now on the database's
        # clock (invariant 33); its end is tracked on this process's monotonic clock, a
        # duration, never a wall time.
        lease_end = time.monotonic() + self.config.lease * START_KEEP
        log: dict[str, Any] = {"outbox_id": unique[0].id, "lease_version": unique[0].lease_version}
        if len(unique) > 1:
            log["batch"] = len(unique)
        undecodable: dict[int, Exception] = {}
        try:
            msgs = self.fence.start(unique, undecodable=undecodable)
        except Exception as exc:
            self.fence.failed_before_handler(unique, exc, log)
            raise
        outcomes = self._stale(unique, {m.id for m in msgs} | set(undecodable), log)
        for x in unique:
            if x.id in undecodable:
                # Its payload, not its neighbours': the failure is its own (invariant 30).
                self.fence.failed_before_handler([x], undecodable[x.id], log)
                outcomes[x.id] = Outcome.ERROR
        by_route: dict[str, list[Message]] = {}
        for msg in msgs:
            by_route.setdefault(msg.route, []).append(msg)
        failure: BaseException | None = None
        for route, group in by_route.items():
            spec = self.handlers.get(route)
            if spec is None:
                outcomes.update(self._unroutable(group, log))
            elif spec.batch is not None:
                try:
                    outcomes.update(self._batch(spec, group, log))
                except BaseException as exc:  # recorded already; the other routes still run
                    outcomes.update(dict.fromkeys((m.id for m in group), Outcome.ERROR))
                    failure = failure or exc
            else:
                done, raised = self._each(spec, group, log, lease_end, batch_done=batch_done)
                outcomes.update(done)
                failure = failure or raised
        if failure is not None:
            raise failure
        return outcomes

    def flush(self) -> None:
        """Write the ``done`` of every handled message this process still holds."""
        if self.done_batch is not None:
            self.done_batch.close()

    # -- the steps of a task ----------------------------------------------------------------------

    @staticmethod
    def _stale(leases: list[Lease], started: set[int], log: dict[str, Any]) -> dict[int, Outcome]:
        stale = [x for x in leases if x.id not in started]
        if stale:
            more = f" (and {len(stale) - 1} more of the task's {len(leases)})" if len(stale) > 1 else ""
            logger.info(
                "outbox id %s version %s is stale or exhausted%s; handler not called",
                stale[0].id,
                stale[0].lease_version,
                more,
                extra={**log, "outcome": Outcome.STALE, "stale": len(stale)},
            )
        return {x.id: Outcome.STALE for x in stale}

    def _unroutable(self, msgs: list[Message], log: dict[str, Any]) -> dict[int, Outcome]:
        """No handler for these rows' route in this worker: postpone, attempt refunded."""
        route = msgs[0].route
        delay = self.config.unroutable_delay
        why = f"unroutable: no handler for event type {route!r} in this worker"
        verdict = Verdict(Outcome.UNROUTABLE, delay=delay, error=why)
        won = self.fence.finish([verdict.finish(m) for m in msgs])
        logger.warning(
            "outbox id %s: no handler for %r here; %s row(s) postponed %.0fs",
            msgs[0].id,
            route,
            len(msgs),
            delay,
            extra={**log, "outcome": Outcome.UNROUTABLE},
        )
        return {m.id: outcome_of(verdict, won.of(m.id)) for m in msgs}

    def _each(
        self,
        spec: HandlerSpec,
        msgs: list[Message],
        log: dict[str, Any],
        lease_end: float,
        *,
        batch_done: bool,
    ) -> tuple[dict[int, Outcome], Exception | None]:
        """A one-message handler for each started message, in claim order (invariant 30).

        An exception a handler raises and does not classify is recorded for its row and
        returned after the rest ran. Past :data:`PACK_SHARE` of a lease no further handler
        starts: the rows left go back to pending at once (:meth:`_hand_back`).
        """
        outcomes: dict[int, Outcome] = {}
        failure: Exception | None = None
        last_start = lease_end - self.config.lease * (1 - PACK_SHARE)
        for i, msg in enumerate(msgs):
            if i and time.monotonic() >= last_start:
                outcomes.update(self._hand_back(msgs[i:], log))
                break
            one = {**log, "outbox_id": msg.id, "lease_version": msg.lease_version}
            one.update(event_type=msg.route, attempt=msg.attempts)
            if len(msgs) > 1:
                one["pack"] = len(msgs)
            try:
                outcomes[msg.id] = self._one(spec, msg, one, lease_end, batch_done=batch_done)
            except Exception as exc:  # recorded and logged for its row; the others still run
                outcomes[msg.id] = Outcome.ERROR
                failure = failure or exc
        return outcomes, failure

    def _one(
        self, spec: HandlerSpec, msg: Message, log: dict[str, Any], lease_end: float, *, batch_done: bool
    ) -> Outcome:
        """A started message's handler, classification and fenced finish; ``lease_end`` is its
        lease's end on this process's monotonic clock. An unclassified exception is recorded
        and re-raised."""
        msg = replace(msg, _extend=self.fence.extender(Lease(msg.id, msg.lease_version)))
        if spec.transaction is not None:
            outcome = self._transactional(spec, spec.transaction, msg, log)
            if outcome is Outcome.DONE and self._slots.wakes_claim(spec):
                self._slots.wake()  # its done committed with the handler's transaction: a slot is free
            return outcome
        started = time.monotonic()
        verdict, raised = self._run_handler(spec, msg, log)
        if self._slots.wakes_claim(spec):
            outcome = self._finish(verdict, msg)
            # A RateLimited outcome holds the type (no claim could use the slot) and a lost
            # lease freed nothing: no wake.
            if outcome not in (Outcome.RATE_LIMITED, Outcome.LOST_LEASE):
                self._slots.wake()
        elif batch_done and verdict.outcome is Outcome.DONE and self._batch_done(msg, lease_end):
            outcome = Outcome.DONE
        else:
            outcome = self._finish(verdict, msg)
        if raised is not None:
            logger.error(
                "outbox id %s handler raised %s: a failed attempt (%s of %s), %s",
                msg.id,
                type(raised).__name__,
                msg.attempts,
                self.config.max_attempts,
                "dead" if outcome is Outcome.DEAD else f"retried in {verdict.delay:.1f}s",
                extra={**log, "outcome": outcome, "duration_ms": ms_since(started)},
            )
            # Celery reports the task failed, as for any task whose function raised.
            raise raised
        logger.info(
            "outbox id %s %s -> %s",
            msg.id,
            msg.route,
            outcome,
            extra={**log, "outcome": outcome, "duration_ms": ms_since(started)},
        )
        return outcome

    def _run_handler(
        self, spec: HandlerSpec, msg: Message, log: dict[str, Any]
    ) -> tuple[Verdict, BaseException | None]:
        """Call a plain handler outside any transaction; the verdict of what it did, and the
        exception it raised without classifying it (a failed attempt, invariant 31)."""
        try:
            # The lease heartbeat is a no-op unless configured; the span continues the producer's
            # trace when it had one (tracing.py).
            with lease_heartbeat(self.config, msg.extend_lease, log=log), handler_span(msg):
                spec.fn(msg)
        except BaseException as exc:
            verdict = classify(exc, msg.attempts, self.retry)
            if verdict is None:
                return failed(exc, msg.attempts, self.retry), exc
            return verdict, None
        return Verdict(Outcome.DONE), None

    def _finish(self, verdict: Verdict, msg: Message) -> Outcome:
        """The verdict's fenced write; :attr:`Outcome.LOST_LEASE` when another claim won."""
        won = self.fence.finish([verdict.finish(msg)])
        return outcome_of(verdict, won.of(msg.id))

    def _hand_back(self, msgs: list[Message], log: dict[str, Any]) -> dict[int, Outcome]:
        """Rows whose handler the task did not run: pending now, attempt refunded (one statement)."""
        finishes = [
            Finish(Lease(m.id, m.lease_version), Step.HAND_BACK, grouped=m.group_id is not None) for m in msgs
        ]
        won = self.fence.finish(finishes, notify=self.config.listen)
        logger.info(
            "outbox pack of %s: %s row(s) handed back unrun (past %.0f%% of the lease)",
            msgs[0].route,
            len(won.applied),
            PACK_SHARE * 100,
            extra={**log, "outcome": "handed_back", "handed_back": len(won.applied)},
        )
        return {m.id: Outcome.HANDED_BACK for m in msgs}

    def _batch_done(self, msg: Message, lease_end: float) -> bool:
        """Queue the done of an unordered row of no group (invariant 29) for the next batch."""
        batch = self.done_batch
        if batch is None or msg.ordering_key is not None or msg.group_id is not None:
            return False
        if lease_end - time.monotonic() <= batch.delay + DONE_BATCH_MARGIN:
            return False
        batch.add(msg.id, msg.lease_version)
        return True

    def _write_done_batch(self, finished: list[Lease]) -> FinalizedMany:
        return self.fence.finish([Finish(x, Step.DONE, grouped=False) for x in finished])
