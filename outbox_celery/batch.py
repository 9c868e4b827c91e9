"""Batch handlers' delivery (invariant 21): one fenced start, the handler once, one fenced
finalize; and packs (invariant 30): one fenced start, then a one-message handler per message.

:class:`BatchDelivery` is the part of :class:`~outbox_celery.dispatch.Dispatcher` that runs
``outbox.deliver_batch`` tasks; it writes through the same completer as the one-message path.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from .complete import Finish, Lease, Step
from .heartbeat import lease_heartbeat
from .message import Message, Outcome
from .verdict import Verdict, _error_text, _ms_since, _outcome_of, classify

if TYPE_CHECKING:
    import psycopg

    from .backoff import RetryPolicy
    from .complete import FinalizedMany
    from .config import OutboxConfig

__all__ = ["PACK_SHARE", "BatchDelivery", "BatchSpec"]

logger = logging.getLogger("outbox_celery.dispatch")

#: The share of a lease within which a pack may start its next handler (invariant 30): past it,
#: the rows it has not run go back to pending at once, so a handler of a pack starts with at
#: least ``1 - PACK_SHARE`` of a lease ahead of it and a slow handler delays its neighbours by
#: at most that much before they are claimed again.
PACK_SHARE = 0.1


def _batch_failures(result: object, ids: set[int]) -> Mapping[int, BaseException]:
    """A batch handler's return value checked: ``{id: exception}`` of the messages not delivered.

    :raises TypeError: anything but ``None`` or a mapping from this batch's ids to exception
        instances (the whole batch is then treated as an unclassified failure).
    """
    if result is None:
        return {}
    if not isinstance(result, Mapping):
        raise TypeError(
            f"a batch handler returns None or a mapping id -> outcome, not {type(result).__name__}"
        )
    for key, value in result.items():
        if key not in ids:
            raise TypeError(f"a batch handler returned an outcome for id {key!r}, which is not in its batch")
        if not isinstance(value, BaseException):
            raise TypeError(
                f"a batch handler's outcome for id {key} must be an exception instance "
                f"(RetryableError, Defer, PermanentError), not {type(value).__name__}"
            )
    return result


class BatchSpec(Protocol):
    """What the batch side reads of a registered handler (:class:`~outbox_celery.dispatch.HandlerSpec`)."""

    @property
    def event_type(self) -> str: ...

    @property
    def fn(self) -> Callable[..., Any]: ...

    @property
    def batch(self) -> int | None: ...

    @property
    def pack(self) -> int: ...


class BatchDelivery:
    """The batch side of :class:`~outbox_celery.dispatch.Dispatcher` (its base class)."""

    config: OutboxConfig
    handlers: Mapping[str, BatchSpec]

    if TYPE_CHECKING:

        @property
        def retry(self) -> RetryPolicy: ...

        def _begin(self, op: str, leases: list[Lease]) -> list[Message]: ...

        def _complete(
            self,
            op: str,
            finishes: Sequence[Finish],
            *,
            notify: bool = False,
            conn: psycopg.Connection[Any] | None = None,
        ) -> FinalizedMany: ...

        def _extend(self, leases: list[Lease], seconds: float) -> bool: ...

        def _pre_handler_failure(self, lease: Lease, exc: Exception) -> Finish: ...

        def _deliver_started(
            self, spec: Any, msg: Message, log: dict[str, Any], lease_end: float, *, batch_done: bool
        ) -> Outcome: ...

    def deliver_batch(self, pairs: Sequence[Lease | tuple[int, int]]) -> dict[str, int]:
        """One batch task: one fenced start, the batch handler once, one fenced finalize; or a
        pack of a one-message handler's rows: one fenced start, then each message as a one-row
        task would deliver it (:meth:`_run_pack`, invariant 30).

        ``pairs`` are the leases (``(id, lease_version)``) the task carries. The start is fenced
        per pair; pairs it does not start (a newer claim, a finished row, a claim started by
        another task) are dropped from the batch and counted ``stale``. The handler receives the
        started messages of its event type, sorted by id, and returns ``None`` (all delivered) or
        a mapping from message id to the outcome of those that were not; an exception it raises
        applies to every message of the batch. Every outcome is written by the completer's one
        fenced statement (an ordered message's done under its key lock, in the same
        transaction). An unclassified exception is
        recorded for every row and re-raised (the rows come back through their lease).

        Returns how many rows ended in each :class:`~outbox_celery.message.Outcome`.
        """
        leases = list(dict.fromkeys(Lease.of(p) for p in pairs))
        counts: Counter[str] = Counter()
        if not leases:
            return {}
        # As deliver's: the start gives each row at least one lease from now (database clock).
        lease_end = time.monotonic() + self.config.lease
        first = leases[0]
        log: dict[str, Any] = {
            "outbox_id": first.id,
            "lease_version": first.lease_version,
            "batch": len(leases),
        }
        try:
            msgs = self._begin("start_many", leases)
        except Exception as exc:
            self._failed_before_batch(leases, exc, log)
            raise
        stale = len(leases) - len(msgs)
        if stale:
            counts[Outcome.STALE] += stale
            logger.info(
                "outbox batch of %s: %s pair(s) stale or exhausted, dropped; handler not called for them",
                len(leases),
                stale,
                extra={**log, "outcome": Outcome.STALE, "stale": stale},
            )
        by_type: dict[str, list[Message]] = {}
        for msg in msgs:
            by_type.setdefault(msg.route, []).append(msg)
        failure: BaseException | None = None
        for event_type, group in by_type.items():
            spec = self.handlers.get(event_type)
            if spec is None:
                counts.update(self._unroutable_batch(group, log).values())
                continue
            if spec.batch is None:
                outcomes, raised = self._run_pack(spec, group, log, lease_end)
                counts.update(outcomes.values())
                failure = failure or raised
                continue
            try:
                counts.update(self._run_batch(spec, group, log).values())
            except BaseException as exc:  # recorded already; the other groups still run
                counts[Outcome.ERROR] += len(group)
                failure = exc
        if failure is not None:
            raise failure
        return {str(k): v for k, v in counts.items()}

    def _run_pack(
        self, spec: BatchSpec, msgs: list[Message], log: dict[str, Any], lease_end: float
    ) -> tuple[dict[int, Outcome], Exception | None]:
        """A pack's started messages, each delivered as a one-row task would (invariant 30).

        In claim order, one handler after another; each outcome is written as the one-row
        task writes it (a done through the done batcher). An exception a handler raises and
        does not classify is recorded for its row (which comes back through its lease) and
        returned after the rest ran. Past :data:`PACK_SHARE` of a lease from the start, no
        further handler starts: the rows left go back to pending at once, their attempt
        refunded (:meth:`_hand_back`).
        """
        outcomes: dict[int, Outcome] = {}
        failure: Exception | None = None
        last_start = lease_end - self.config.lease * (1 - PACK_SHARE)
        for i, msg in enumerate(msgs):
            if i and time.monotonic() >= last_start:
                outcomes.update(self._hand_back(msgs[i:], log))
                break
            one = {**log, "outbox_id": msg.id, "lease_version": msg.lease_version}
            one.update(event_type=msg.route, attempt=msg.attempts, pack=len(msgs))
            try:
                outcomes[msg.id] = self._deliver_started(spec, msg, one, lease_end, batch_done=True)
            except Exception as exc:  # recorded and logged for its row; the others still run
                outcomes[msg.id] = Outcome.ERROR
                failure = failure or exc
        return outcomes, failure

    def _hand_back(self, msgs: list[Message], log: dict[str, Any]) -> dict[int, Outcome]:
        """A pack's rows whose handler did not run: pending now, attempt refunded (one statement)."""
        finishes = [
            Finish(Lease(m.id, m.lease_version), Step.HAND_BACK, grouped=m.group_id is not None) for m in msgs
        ]
        won = self._complete("hand_back", finishes, notify=self.config.listen)
        logger.info(
            "outbox pack of %s: %s row(s) handed back unrun (past %.0f%% of the lease)",
            msgs[0].route,
            len(won.applied),
            PACK_SHARE * 100,
            extra={**log, "outcome": "handed_back", "handed_back": len(won.applied)},
        )
        return {m.id: Outcome.HANDED_BACK for m in msgs}

    def _run_batch(self, spec: BatchSpec, msgs: list[Message], log: dict[str, Any]) -> dict[int, Outcome]:
        """Call a batch handler on started messages, then write every outcome (one statement)."""
        assert spec.batch is not None
        cfg = self.config
        leases = [Lease(m.id, m.lease_version) for m in msgs]
        msgs = [replace(m, _extend=self._extender(m.id, m.lease_version)) for m in msgs]
        log = {**log, "event_type": spec.event_type, "batch": len(msgs)}
        started = time.monotonic()
        try:
            with lease_heartbeat(cfg, lambda seconds: self._extend(leases, seconds), log=log):
                result = spec.fn(list(msgs))
            failures = _batch_failures(result, {m.id for m in msgs})
        except BaseException as exc:
            verdicts = {m.id: classify(exc, m.attempts, self.retry) for m in msgs}
            if any(v is None for v in verdicts.values()):
                # Not classified: recorded for every row, which comes back through its lease.
                error = _error_text(exc)
                self._finish_batch(msgs, dict.fromkeys(verdicts, Verdict(Outcome.ERROR, error=error)))
                logger.error(
                    "outbox batch of %s %s raised %s; rows return after their lease",
                    len(msgs),
                    spec.event_type,
                    type(exc).__name__,
                    extra={**log, "outcome": Outcome.ERROR, "duration_ms": _ms_since(started)},
                )
                raise
            whole = {i: v for i, v in verdicts.items() if v is not None}
        else:
            whole = {}
            for m in msgs:
                failed = failures.get(m.id)
                if failed is None:
                    whole[m.id] = Verdict(Outcome.DONE)
                else:
                    # A non-outcome exception for one message: recorded, back through its lease.
                    whole[m.id] = classify(failed, m.attempts, self.retry) or Verdict(
                        Outcome.ERROR, error=_error_text(failed)
                    )
        outcomes = self._finish_batch(msgs, whole)
        tally = Counter(outcomes.values())
        logger.info(
            "outbox batch of %s %s -> %s",
            len(msgs),
            spec.event_type,
            ", ".join(f"{k}={n}" for k, n in sorted(tally.items())),
            extra={
                **log,
                "outcome": "batch",
                **{str(k): n for k, n in tally.items()},
                "duration_ms": _ms_since(started),
            },
        )
        return outcomes

    def _finish_batch(self, msgs: list[Message], verdicts: Mapping[int, Verdict]) -> dict[int, Outcome]:
        """Write a batch's verdicts: the completer's one fenced statement for them all (an
        ordered done under its key lock, a RateLimited item's hold, in the same transaction)."""
        finishes = [verdicts[m.id].finish(m) for m in msgs]
        # Wake the claim: a batch's leases ended at once, room under the bound.
        won = self._complete("finish_many", finishes, notify=self.config.listen)
        return {m.id: _outcome_of(verdicts[m.id], won.of(m.id)) for m in msgs}

    def _unroutable_batch(self, msgs: list[Message], log: dict[str, Any]) -> dict[int, Outcome]:
        """No batch handler for these messages here (a deploy changed it): postpone, attempt refunded."""
        event_type = msgs[0].route
        delay = self.config.unroutable_delay
        why = f"unroutable: no batch handler for event type {event_type!r} in this worker"
        verdict = Verdict(Outcome.UNROUTABLE, delay=delay, error=why)
        won = self._complete("postpone", [verdict.finish(m) for m in msgs])
        logger.warning(
            "outbox batch of %s %r: no batch handler here; postponed %.0fs",
            len(msgs),
            event_type,
            delay,
            extra={**log, "outcome": Outcome.UNROUTABLE},
        )
        return {m.id: _outcome_of(verdict, won.of(m.id)) for m in msgs}

    def _failed_before_batch(self, leases: list[Lease], exc: Exception, log: dict[str, Any]) -> None:
        """The batch's start failed: each lease as :meth:`_failed_before_handler`, in one statement."""
        try:
            self._complete("finish_retry", [self._pre_handler_failure(x, exc) for x in leases])
        except Exception:
            logger.exception("outbox batch: could not record the failure before the handler", extra=log)
        logger.error(
            "outbox batch of %s: outbox-celery failed before calling the handler (%s: %s); the "
            "handler did not run, the messages are retried after a backoff",
            len(leases),
            type(exc).__name__,
            exc,
            extra={**log, "outcome": Outcome.ERROR},
        )

    def _extender(self, outbox_id: int, lease_version: int) -> Callable[[float], bool]:
        """The lease heartbeat's extension of one row (a message's ``extend_lease``)."""
        return lambda seconds: self._extend([Lease(outbox_id, lease_version)], seconds)
