"""The expired leases a claim gives back or ends (DESIGN invariants 5 and 10): their rows and
the warnings that name them, with the database when an Outbox serves several (invariant 34)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple, Protocol

from ..table import TableName

__all__ = ["FirstExpiredRow", "Maintenance", "ReapedRow", "ReleasedRow", "log_reaped", "log_released"]

logger = logging.getLogger("outbox_celery.claim.executor")


class Store(Protocol):
    """What the warnings name of the claim's :class:`~outbox_celery.db.store.Store`."""

    table: TableName
    on: str
    log_fields: dict[str, str]


class FirstExpiredRow(NamedTuple):
    """The earliest lease that ran out since the expired mark (``first_expired``)."""

    lease_until: datetime


class ReleasedRow(NamedTuple):
    """A row ``release_expired`` gave back to pending."""

    id: int
    lease_version: int
    event_type: str
    routable: bool
    unstarted_claims: int


class ReapedRow(NamedTuple):
    """A row ``reap`` made dead."""

    id: int
    lease_version: int
    event_type: str


@dataclass(frozen=True, slots=True)
class Maintenance:
    """What a claim's maintenance step did before it claimed."""

    #: Expired claims whose task never started, back to pending.
    lost: int
    #: Expired leases of types without a handler here, back to pending as unroutable.
    unroutable: int
    #: Expired leases with no attempt left, now dead.
    reaped: int
    #: A statement filled its batch: more expired leases may wait (the expired mark stays).
    full: bool
    #: A lease ran out since the expired mark (``first_expired``); when none did, no expired
    #: scan runs, ``claim_expired`` included.
    expired: bool = True


def log_released(rows: Sequence[ReleasedRow], store: Store) -> tuple[int, int]:
    """Log the lost and unroutable leases ``release_expired`` gave back; their counts."""
    lost: Counter[str] = Counter(r.event_type for r in rows if r.routable)
    unroutable: Counter[str] = Counter(r.event_type for r in rows if not r.routable)
    for event_type, n in sorted(lost.items()):
        most = max(r.unstarted_claims for r in rows if r.event_type == event_type and r.routable)
        logger.warning(
            "outbox%s: %s claim(s) of %r expired without a worker starting them (up to %s in a "
            "row); back to pending, no attempt spent (after a delay once it repeats). Does its queue "
            "have a consumer?",
            store.on,
            n,
            event_type,
            most,
            extra={
                "event_type": event_type,
                "outcome": "lost_task",
                "released": n,
                "unstarted_claims": most,
                "outbox_table": store.table.qualified,
                **store.log_fields,
            },
        )
    for event_type, n in sorted(unroutable.items()):
        logger.warning(
            "outbox%s: %s expired lease(s) of %r, which has no handler here: back to pending as "
            "unroutable, no attempt spent",
            store.on,
            n,
            event_type,
            extra={
                "event_type": event_type,
                "outcome": "unroutable",
                "released": n,
                "outbox_table": store.table.qualified,
                **store.log_fields,
            },
        )
    return sum(lost.values()), sum(unroutable.values())


def log_reaped(rows: Sequence[ReapedRow], store: Store) -> None:
    for row in rows:
        logger.warning(
            "outbox id %s%s went dead: attempts exhausted and lease expired",
            row.id,
            store.on,
            extra={
                "outbox_id": row.id,
                "lease_version": row.lease_version,
                "event_type": row.event_type,
                "outcome": "dead",
                "outbox_table": store.table.qualified,
                **store.log_fields,
            },
        )
