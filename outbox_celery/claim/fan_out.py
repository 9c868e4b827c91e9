"""The claim's safety net for subscriptions (DESIGN invariant 28): nothing depends on who started
first.

The producer's insert fans an event out to its type's live subscriptions. A row written when the
type had none yet (before any worker registered them), by SQL, or by a producer of an older
release is a bare row of a subscribed type: no handler takes its type, so no claim would ever
take it. A claim that makes a full pass (a process's first, then every ``full_scan_interval``)
fans such rows out in its own transaction, before it claims, exactly as the producer would have,
and goes on doing so claim after claim while it finds a full batch of them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import psycopg

from ..db import rows

__all__ = ["BATCH", "fan_out_bare"]

logger = logging.getLogger(__name__)

#: Bare rows fanned out per kind (unordered, ordered) per claim.
BATCH = 1000


class Store(Protocol):
    """What the fan-out uses of :class:`~outbox_celery.db.store.Store`."""

    @property
    def _q(self) -> Mapping[str, Any]:
        """The named queries, bound to the store's table."""

    def subscriptions_ready(self, conn: psycopg.Connection[Any]) -> bool: ...

    def _count(self, key: str, n: int = 1) -> None: ...


class _Type(NamedTuple):
    event_type: str


class _Fanned(NamedTuple):
    fanned: int
    added: int


def fan_out_bare(store: Store, conn: psycopg.Connection[Any], *, limit: int = BATCH) -> int:
    """Fan out up to ``limit`` unordered and ``limit`` ordered bare rows of subscribed types;
    how many were fanned out (``limit`` or more: more may remain). Runs inside the claim's
    transaction."""
    if not store.subscriptions_ready(conn):
        return 0
    types = [r.event_type for r in rows.read(conn, _Type, store._q["subscribed_types"], {})]
    if not types:
        return 0
    [done] = rows.read(conn, _Fanned, store._q["fan_out_bare"], {"types": types, "limit": limit})
    if done.fanned:
        store._count("fanned_out", done.fanned)
        logger.warning(
            "outbox: %s row(s) of a subscribed type had no route (written before their "
            "subscriptions were registered, or not by this library's producer): fanned out to "
            "their subscriptions now, %s row(s) added",
            done.fanned,
            done.added,
            extra={"outcome": "fanned_out", "fanned": done.fanned, "added": done.added},
        )
    return int(done.fanned)
