"""The Celery tasks of an outbox: ``<name>.claim``, ``<name>.deliver``, ``<name>.deliver_batch``
and ``<name>.purge``.

Each task is a thin shell around the outbox it is registered for: the claim task runs a claim
(coalesced, :class:`CoalescedClaims`), both delivery tasks call the deliverer's one method (one
lease is a task of one), the purge task the retention purge. They are registered on the outbox's
app only (``shared=False``), and the delivery tasks never use Celery's retries: every row comes
back through its lease, fenced (DESIGN invariant 14).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from celery import Celery, Task

from ..claim.claimer import ClaimRun, StoppedBy
from ..worker.deliverer import Deliverer, tally

__all__ = ["CoalescedClaims", "OutboxTasks", "TaskedOutbox", "register_tasks"]


class TaskedOutbox(Protocol):
    """What the tasks need of an outbox: an :class:`~outbox_celery.app.outbox.Outbox` is one.

    Described here rather than imported, so that this module does not import ``celery_app``.
    """

    app: Celery
    name: str

    def deliverer_for(self, database: str | None) -> Deliverer: ...

    def purge(self) -> int: ...


class OutboxTasks(NamedTuple):
    """The tasks :func:`register_tasks` registered."""

    claim: Task[Any, Any]
    deliver: Task[Any, Any]
    deliver_batch: Task[Any, Any]
    purge: Task[Any, Any]


class CoalescedClaims:
    """The claim task's body: a claim run, unless this process just drained the table.

    Claim tasks pile up behind a claim worker that was stopped or paused while beat kept
    sending (their ``expires`` leaves minutes for clock skew). Run back to back they would each
    claim an empty batch; a run that arrives within half a ``claim_interval`` of this process's
    last run that found nothing more to claim returns at once. Durations are measured on this
    process's monotonic clock, never compared with another's.

    :param claim: runs one claim.
    :param claim_interval: returns the outbox's ``claim_interval`` (read when a task runs: the
        configuration may not be loaded when the task is registered).
    """

    def __init__(self, claim: Callable[[], ClaimRun], claim_interval: Callable[[], float]) -> None:
        self._claim = claim
        self._claim_interval = claim_interval
        self._last_drained: float | None = None

    def __call__(self) -> ClaimRun:
        last = self._last_drained
        if last is not None and time.monotonic() - last < self._claim_interval() / 2:
            return ClaimRun(skipped=True, stopped_by=StoppedBy.COALESCED)
        run = self._claim()
        self._last_drained = time.monotonic() if run.stopped_by == StoppedBy.DRAINED else None
        return run


def register_tasks(outbox: TaskedOutbox, claim: Callable[[], ClaimRun]) -> OutboxTasks:
    """Register ``outbox``'s four tasks on its app, named ``<outbox.name>.<task>``.

    :param claim: the claim task's body (a :class:`CoalescedClaims`).
    """
    app, name = outbox.app, outbox.name

    # shared=False: these tasks close over this outbox; they must not be copied into every
    # other app created in the process (Celery's default for decorated tasks).
    @app.task(name=f"{name}.claim", ignore_result=True, acks_late=False, shared=False)
    def claim_task() -> dict[str, Any]:
        """Reap, claim and publish (triggered by beat every ``claim_interval``)."""
        return claim().as_dict()

    # Both delivery tasks: acked late, and a lost worker acks its message too (every row
    # comes back through its lease, fenced); never Celery's retries (DESIGN invariant 14).
    delivery: dict[str, Any] = {
        "ignore_result": True,
        "acks_late": True,
        "reject_on_worker_lost": False,
        "max_retries": 0,
        "shared": False,
    }

    @app.task(name=f"{name}.deliver", **delivery)
    def deliver(outbox_id: int, lease_version: int, database: str | None = None) -> str:
        """Deliver one outbox row (fenced start, handler, fenced finalize); ``database`` names
        its database when the outbox serves several (DESIGN invariant 34)."""
        outbox_id = int(outbox_id)
        deliverer = outbox.deliverer_for(database)
        return deliverer.deliver([(outbox_id, int(lease_version))], batch_done=True)[outbox_id]

    @app.task(name=f"{name}.deliver_batch", **delivery)
    def deliver_batch(ids: list[int], versions: list[int], database: str | None = None) -> dict[str, int]:
        """Deliver a batch handler's rows or a pack (one fenced start, then the handlers)."""
        pairs = [(int(i), int(v)) for i, v in zip(ids, versions, strict=True)]
        return tally(outbox.deliverer_for(database).deliver(pairs, batch_done=True))

    @app.task(name=f"{name}.purge", ignore_result=True, shared=False)
    def purge() -> int:
        """Delete ``done`` rows older than ``retention`` in bounded batches."""
        return outbox.purge()

    return OutboxTasks(claim_task, deliver, deliver_batch, purge)
