"""One claim or one fenced write of a :class:`Store`'s table at a time, as the tests drive them.

The worker writes through :class:`~outbox_celery.db.completer.Completer` (``store.completer``)
and the claim through :func:`outbox_celery.claim.executor.claim`; these helpers call exactly
those, one step per call, with the one-row shapes the tests read best (``done(store, conn, id,
version)``). A limit a step does not read (a retry's ``max_attempts``, a defer's ``max_age``) is
passed as zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from outbox_celery.claim import executor
from outbox_celery.claim.executor import Claimed, ClaimResult
from outbox_celery.db.completer import Finalized, FinalizedMany, Finish, Lease, Step
from outbox_celery.db.store import Store, starter_token
from outbox_celery.message import Message

__all__ = [
    "claim",
    "dead",
    "defer",
    "done",
    "done_many",
    "extend_lease",
    "extend_leases",
    "finish_many",
    "postpone",
    "rate_limited",
    "record_error",
    "release",
    "retry",
    "start",
    "start_many",
]

Conn = psycopg.Connection[Any]


def claim(store: Store, conn: Conn, **kw: Any) -> ClaimResult:
    """One claim transaction (:func:`outbox_celery.claim.executor.claim`)."""
    return executor.claim(store, conn, **kw)


def release(store: Store, conn: Conn, claims: Sequence[Claimed]) -> int:
    """Give unpublished claims back (:meth:`Store.release` of their leases)."""
    return store.release(conn, [c.lease for c in claims])


def start(
    store: Store,
    conn: Conn,
    outbox_id: int,
    lease_version: int,
    *,
    lease: float,
    max_attempts: int,
    starter: str | None = None,
) -> Message | None:
    """The fenced start of one claim; ``None`` when it did not start.

    :param starter: the start's token (a fresh one by default); given, a start whose reply was
        lost is resumed under it.
    """
    started = store.completer.start(
        conn,
        [Lease(outbox_id, lease_version)],
        lease=lease,
        max_attempts=max_attempts,
        starter=starter or starter_token(),
        resume=starter is not None,
    )
    return started[0] if started else None


def start_many(
    store: Store,
    conn: Conn,
    pairs: Sequence[Lease | tuple[int, int]],
    *,
    lease: float,
    max_attempts: int,
    starter: str,
) -> list[Message]:
    """The fenced start of many leases (or ``(id, lease_version)`` pairs); sorted by id."""
    leases = [Lease.of(p) for p in pairs]
    return store.completer.start(conn, leases, lease=lease, max_attempts=max_attempts, starter=starter)


def finish_many(
    store: Store,
    conn: Conn,
    finishes: Sequence[Finish],
    *,
    max_attempts: int = 0,
    max_age: float = 0.0,
    notify: bool = False,
    joined: bool = False,
) -> FinalizedMany:
    """The completer's one fenced finalize of ``finishes``."""
    return store.completer.finish(
        conn, finishes, max_attempts=max_attempts, max_age=max_age, notify=notify, joined=joined
    )


def _one(store: Store, conn: Conn, finish: Finish, **kw: Any) -> Finalized:
    return finish_many(store, conn, [finish], **kw).of(finish.lease.id)


def done(
    store: Store,
    conn: Conn,
    outbox_id: int,
    lease_version: int,
    *,
    ordered: bool | None = None,
    joined: bool = False,
    grouped: bool | None = None,
) -> Finalized:
    """Fenced ``done`` of one row (an ordered row's key lock taken unless ``ordered=False``)."""
    finish = Finish(Lease(outbox_id, lease_version), Step.DONE, ordered=ordered, grouped=grouped)
    return _one(store, conn, finish, joined=joined)


def done_many(store: Store, conn: Conn, finished: Sequence[Lease | tuple[int, int]]) -> FinalizedMany:
    """Fenced ``done`` of many unordered leases in one statement (an ordered row is refused)."""
    return finish_many(store, conn, [Finish(Lease.of(p), Step.DONE) for p in finished])


def retry(
    store: Store,
    conn: Conn,
    outbox_id: int,
    lease_version: int,
    *,
    delay: float,
    error: str,
    max_attempts: int,
) -> Finalized:
    """Fenced retryable failure: ``pending`` after ``delay``, or ``dead`` at the limit."""
    finish = Finish(Lease(outbox_id, lease_version), Step.RETRY, delay, error)
    return _one(store, conn, finish, max_attempts=max_attempts)


def defer(
    store: Store, conn: Conn, outbox_id: int, lease_version: int, *, delay: float, reason: str, max_age: float
) -> Finalized:
    """Fenced defer, the attempt refunded: ``pending``, or ``dead`` past ``max_age``."""
    finish = Finish(Lease(outbox_id, lease_version), Step.DEFER, delay, reason)
    return _one(store, conn, finish, max_age=max_age)


def rate_limited(
    store: Store, conn: Conn, outbox_id: int, lease_version: int, *, delay: float, reason: str, max_age: float
) -> Finalized:
    """Fenced RateLimited outcome: as :func:`defer`, and the row's type (or key) held as long."""
    finish = Finish(Lease(outbox_id, lease_version), Step.RATE_LIMITED, delay, reason)
    return _one(store, conn, finish, max_age=max_age)


def dead(store: Store, conn: Conn, outbox_id: int, lease_version: int, *, error: str) -> Finalized:
    """Fenced: ``dead`` with ``error``."""
    return _one(store, conn, Finish(Lease(outbox_id, lease_version), Step.DEAD, error=error))


def record_error(store: Store, conn: Conn, outbox_id: int, lease_version: int, *, error: str) -> Finalized:
    """Fenced: ``error`` kept, the row left ``processing`` to return through its lease."""
    return _one(store, conn, Finish(Lease(outbox_id, lease_version), Step.ERROR, error=error))


def postpone(
    store: Store, conn: Conn, outbox_id: int, lease_version: int, *, delay: float, error: str
) -> Finalized:
    """Fenced: back to pending after ``delay``, the attempt refunded (no handler here)."""
    return _one(store, conn, Finish(Lease(outbox_id, lease_version), Step.POSTPONE, delay, error))


def extend_lease(store: Store, conn: Conn, outbox_id: int, lease_version: int, *, seconds: float) -> bool:
    """Fenced lease extension of one row; whether the lease held."""
    return bool(store.completer.extend(conn, [Lease(outbox_id, lease_version)], seconds=seconds))


def extend_leases(
    store: Store, conn: Conn, pairs: Sequence[Lease | tuple[int, int]], *, seconds: float
) -> set[int]:
    """Fenced lease extension of many leases in one statement; the ids extended."""
    return store.completer.extend(conn, [Lease.of(p) for p in pairs], seconds=seconds)
