"""The vocabulary of outcomes: what a delivery did (:class:`Outcome`), what a finalize writes
(:class:`Step`), and the one table between them (:data:`STEPS`).

Each step has one row: the name its writes are logged under, the counter a won write adds to
(:meth:`Store.get_stats() <outbox_celery.db.store.Store.get_stats>`), whether it can make a row
done or dead, and the outcome a handler's verdict of it reports. Everything else is derived from
the table: the completer's counters and log names, the steps the plain ``finish`` statement
writes for a group's member (the SQL's list is generated from :data:`NOT_FINAL`), the step of
each verdict, :attr:`Outcome.counter`. What each step does to the row is written once, in the
``finish`` statement (``db/sql/queries.sql``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["NOT_FINAL", "STEPS", "Outcome", "Row", "Step", "operation", "row", "step_of"]


class Outcome(enum.StrEnum):
    """What one delivery did: the delivery task's return value and the log's ``outcome``."""

    DONE = "done"
    RETRY = "retry"
    DEFER = "defer"
    DEAD = "dead"
    ERROR = "error"
    STALE = "stale"
    LOST_LEASE = "lost_lease"
    UNROUTABLE = "unroutable"
    #: A :class:`~outbox_celery.errors.RateLimited` outcome: held with its event type.
    RATE_LIMITED = "rate_limited"
    #: A pack's row whose handler its task did not run: pending again, attempt refunded.
    HANDED_BACK = "handed_back"

    @property
    def counter(self) -> str:
        """The :meth:`Store.get_stats() <outbox_celery.db.store.Store.get_stats>` key counting it."""
        return _COUNTER_OF.get(self, self.value)


class Step(enum.StrEnum):
    """What a finalize writes; each step's rule lives in the ``finish`` statement only."""

    #: ``done``; an ordered row hands its key's head to the next message (invariant 9).
    DONE = "done"
    #: Back to ``pending`` after the delay, the attempt kept; ``dead`` once attempts are spent.
    RETRY = "retry"
    #: Back to ``pending`` after the delay, attempt refunded; ``dead`` past ``max_defer_age``.
    DEFER = "defer"
    #: As :attr:`DEFER`, and the event type (or limit key) held as long (invariant 23).
    RATE_LIMITED = "rate_limited"
    #: ``dead`` with the error.
    DEAD = "dead"
    #: The error kept; the row stays ``processing`` and returns through its lease.
    ERROR = "error"
    #: Back to ``pending`` after the delay, attempt refunded: no handler here (unroutable).
    POSTPONE = "postpone"
    #: Back to ``pending`` now, nothing spent, only while the claim never started (invariant 12).
    RELEASE = "release"
    #: Back to ``pending`` now, attempt refunded, ``last_error`` kept: a started pack's row whose
    #: handler its task did not run (invariant 30).
    HAND_BACK = "hand_back"


@dataclass(frozen=True, slots=True)
class Row:
    """One step's row of :data:`STEPS`.

    :ivar step: the step.
    :ivar operation: what its writes are called in the logs (a lost lease, a retried write).
    :ivar counter: the ``get_stats()`` key a won write of it adds one to; ``None``: not counted.
        A write that made the row ``dead`` (a retry or defer past its limit) counts ``dead``.
    :ivar final: whether it can make a row done or dead. A step that never does counts in no
        group (DESIGN invariant 29): the plain ``finish`` statement writes it for any row.
    :ivar outcome: what a handler's verdict of it reports; ``None``: no verdict writes it.
    """

    step: Step
    operation: str
    counter: str | None
    final: bool
    outcome: Outcome | None


#: The one table of the steps (the counters' names are documented in docs/operations.md).
STEPS: tuple[Row, ...] = (
    # Row(step, operation, counter, final, the outcome a verdict of it reports)
    Row(Step.DONE, "finish_done", "done", True, Outcome.DONE),
    Row(Step.RETRY, "finish_retry", "retried", True, Outcome.RETRY),
    Row(Step.DEFER, "finish_defer", "deferred", True, Outcome.DEFER),
    Row(Step.RATE_LIMITED, "finish_rate_limited", "rate_limited", True, Outcome.RATE_LIMITED),
    Row(Step.DEAD, "finish_dead", "dead", True, Outcome.DEAD),
    Row(Step.ERROR, "record_error", "errors", False, Outcome.ERROR),
    # A delivery's postpone is not counted; "unroutable" counts what the claim gives back.
    Row(Step.POSTPONE, "postpone", None, False, Outcome.UNROUTABLE),
    Row(Step.RELEASE, "release", "released", False, None),
    Row(Step.HAND_BACK, "hand_back", "handed_back", False, Outcome.HANDED_BACK),
)

#: The counters of the outcomes no finalize writes: a start refused, a fence lost.
UNWRITTEN: tuple[tuple[Outcome, str], ...] = (
    (Outcome.STALE, "stale_starts"),
    (Outcome.LOST_LEASE, "lost_leases"),
)

_ROWS: Mapping[Step, Row] = MappingProxyType({r.step: r for r in STEPS})
_STEP_OF: Mapping[Outcome, Step] = MappingProxyType({r.outcome: r.step for r in STEPS if r.outcome})
# Outcome.counter: a step's counter under its verdict's outcome, then the unwritten ones; any
# other outcome is counted under its own value.
_COUNTER_OF: Mapping[Outcome, str] = MappingProxyType(
    {**{r.outcome: r.counter for r in STEPS if r.outcome and r.counter}, **dict(UNWRITTEN)}
)

#: The steps that never make a row done or dead, in the table's order.
NOT_FINAL: tuple[Step, ...] = tuple(r.step for r in STEPS if not r.final)


def row(step: Step) -> Row:
    """The table's row of ``step``."""
    return _ROWS[step]


def step_of(outcome: Outcome) -> Step:
    """The step a verdict of ``outcome`` writes.

    :raises KeyError: no verdict reports ``outcome`` (stale, lost_lease).
    """
    return _STEP_OF[outcome]


def operation(steps: Iterable[Step]) -> str:
    """What a write of ``steps`` is called in the logs: its step's operation, or ``finish``
    when it writes several steps."""
    distinct = set(steps)
    if len(distinct) == 1:
        [step] = distinct
        return _ROWS[step].operation
    return "finish"
