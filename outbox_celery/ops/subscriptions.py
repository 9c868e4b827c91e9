"""Subscriptions of an outbox table: several named handlers per event type (DESIGN invariant 28).

The subscriptions are rows of ``<table>_subscription`` (migration 0011), which the producers'
insert reads to fan an event out: one delivery row per live subscription, its ``event_type``
the route ``<event_type>@<name>``. Workers add the subscriptions their handlers declare at
start-up (:func:`register`); operators list, add (optionally replaying retained history) and
remove them (``outbox-celery subscriptions``). SQL in ``sql/subscriptions.sql``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, NamedTuple

import psycopg
from psycopg import sql

from ..config import TableName
from ..db import statements as _sql
from ..errors import AdminError
from ..handlers import subscription_route
from ..message import route, split_route
from ._queries import many, regclass, value, values

__all__ = ["REPLAY_BATCH", "Subscription", "add", "list_subscriptions", "register", "remove", "routes"]

logger = logging.getLogger(__name__)

#: Facts replayed per transaction (:func:`add` with ``replay_since``).
REPLAY_BATCH = 1000


@dataclass(frozen=True, slots=True)
class Subscription:
    """One subscription and its unfinished rows (each counted up to a cap)."""

    event_type: str
    name: str
    created_at: datetime
    removed_at: datetime | None
    pending: int
    processing: int
    dead: int

    @property
    def route(self) -> str:
        """``<event_type>@<name>``: its rows' ``event_type``, its flow-control and stats key."""
        return route(self.event_type, self.name)

    def as_dict(self) -> dict[str, Any]:
        """The fields and the route, JSON-ready."""
        d = asdict(self)
        d["route"] = self.route
        d["created_at"] = self.created_at.isoformat()
        d["removed_at"] = self.removed_at.isoformat() if self.removed_at else None
        return d


@functools.cache
def _queries(table: TableName) -> dict[str, sql.Composed]:
    return {**_sql.queries("queries.sql", table), **_sql.queries("subscriptions.sql", table)}


def _q(table: str | TableName, name: str) -> sql.Composed:
    return _queries(TableName.parse(table))[name]


class _Registered(NamedTuple):
    """A row of ``register``: ``what`` is ``added`` or ``removed`` (by an operator, kept so)."""

    what: str
    event_type: str
    name: str


class _Fact(NamedTuple):
    """A row of ``replay_facts``: a retained fact and its producer's ordering key (``k``)."""

    id: int
    k: str | None


def _ready(conn: psycopg.Connection[Any], table: str | TableName) -> bool:
    t = TableName.parse(table)
    name = t.identifier(_sql.SUBSCRIPTION_SUFFIX).as_string(conn)
    return bool(value(conn, _q(t, "exists"), {"subscription_table": name}))


def register(conn: psycopg.Connection[Any], table: str | TableName, routes: Iterable[str]) -> list[str]:
    """Add the subscriptions among ``routes`` (a worker's handler keys) that the table lacks.

    Routes without a name are ignored. One an operator removed stays removed (logged): a worker
    does not bring it back, ``outbox-celery subscriptions add`` does. Returns the routes added.
    A table not migrated to 0011 adds nothing (logged).
    """
    named = sorted({(t, n) for t, n in map(split_route, routes) if n is not None})
    if not named:
        return []
    if not _ready(conn, table):
        logger.error("outbox table %s has no subscription table: run outbox-celery migrate", table)
        return []
    params = {"event_types": [t for t, _ in named], "names": [n for _, n in named]}
    rows = many(conn, _q(table, "register"), params, _Registered)
    for r in rows:
        if r.what == "removed":
            logger.warning(
                "subscription %s was removed by an operator: its handler receives nothing new "
                "until outbox-celery subscriptions add brings it back",
                route(r.event_type, r.name),
            )
    return [route(r.event_type, r.name) for r in rows if r.what == "added"]


def list_subscriptions(
    conn: psycopg.Connection[Any],
    table: str | TableName = "outbox",
    *,
    event_type: str | None = None,
    cap: int = 10_000,
) -> list[Subscription]:
    """Every subscription (removed ones too), with its unfinished rows counted up to ``cap``."""
    if not _ready(conn, table):
        return []
    return many(conn, _q(table, "list"), {"event_type": event_type, "cap": cap}, Subscription)


def routes(conn: psycopg.Connection[Any], table: str | TableName, event_type: str) -> list[str]:
    """The routes of ``event_type``'s subscriptions, removed ones too, by name: what pausing or
    resuming the type reaches (:func:`outbox_celery.ops.flow.pause`). Empty for a route, for
    a type without subscriptions and for a table not migrated to 0011."""
    if split_route(event_type)[1] is not None or not _ready(conn, table):
        return []
    return [str(r) for r in values(conn, _q(table, "routes"), {"event_type": event_type})]


def remove(conn: psycopg.Connection[Any], table: str | TableName, event_type: str, name: str) -> bool:
    """Remove a subscription: producers stop fanning out to it at once (their next statement).

    Its undelivered rows stay as they are, visible under their route (``stats``, dead letters,
    :func:`list_subscriptions`); a worker without the handler never claims them. Skip or purge
    them deliberately. Returns whether it was live.
    """
    _check(event_type, name)
    return bool(values(conn, _q(table, "remove"), {"event_type": event_type, "name": name}))


def _check(event_type: str, name: str) -> None:
    try:
        subscription_route(event_type, name)
    except ValueError as exc:
        raise AdminError(str(exc)) from exc


def add(
    conn: psycopg.Connection[Any],
    table: str | TableName,
    event_type: str,
    name: str,
    *,
    replay_since: datetime | None = None,
    batch_size: int = REPLAY_BATCH,
) -> int:
    """Add (or bring back) a subscription; it receives the events whose insert statement runs
    after this commits. Returns the rows replayed.

    With ``replay_since``, it first receives the retained events of ``event_type`` written
    from that time (a replay): in batches of ``batch_size`` facts, each its own transaction,
    under the producers' key locks, before the subscription is live, then the facts written
    meanwhile with the add itself, in one transaction; each replayed row reads its fact's
    payload (stored once). Replaying again writes nothing twice. A replay for a subscription
    that is live already (a worker added it) writes its rows after the ones it has: its
    ordered events of a key then come after the live ones. ``conn`` must then not be inside a
    transaction.
    """
    _check(event_type, name)
    if not _ready(conn, table):
        raise AdminError(f"outbox table {table} has no subscription table: run outbox-celery migrate")
    replayed = 0
    if replay_since is not None:
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            raise AdminError("a replay runs its own transactions: call it outside a transaction")
        bound = int(value(conn, _q(table, "replay_until")) or 0)
        replayed, last = _replay(conn, table, event_type, name, replay_since, 0, bound, batch_size)
        with conn.transaction():
            _add_row(conn, table, event_type, name)
            replayed += _replay(conn, table, event_type, name, replay_since, last, None, None)[0]
    else:
        _add_row(conn, table, event_type, name)
    return replayed


def _add_row(conn: psycopg.Connection[Any], table: str | TableName, event_type: str, name: str) -> None:
    conn.execute(_q(table, "add"), {"event_type": event_type, "name": name})


def _replay(
    conn: psycopg.Connection[Any],
    table: str | TableName,
    event_type: str,
    name: str,
    since: datetime,
    after: int,
    until: int | None,
    batch_size: int | None,
) -> tuple[int, int]:
    """Replay facts after id ``after`` (to ``until``), a batch per transaction (one transaction
    of every remaining fact when ``batch_size`` is None). Returns (rows, last fact id)."""
    t = TableName.parse(table)
    table_regclass = regclass(conn, t)
    total = 0
    limit = batch_size or 2**31 - 1
    while True:
        params = {
            "event_type": event_type,
            "route": route(event_type, name),
            "since": since,
            "after": after,
            "until": until if until is not None else 2**63 - 1,
            "limit": limit,
        }
        with conn.transaction():
            facts = many(conn, _q(t, "replay_facts"), params, _Fact)
            if not facts:
                return total, after
            keys = sorted({f.k for f in facts if f.k})
            if keys:
                conn.execute(_q(t, "lock_keys"), {"table": table_regclass, "keys": keys})
            ids = [int(f.id) for f in facts]
            total += len(values(conn, _q(t, "replay_insert"), {**params, "ids": ids}))
            after = ids[-1]
        if batch_size is None or len(facts) < limit:
            return total, after
