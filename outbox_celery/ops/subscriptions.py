"""Subscriptions of an outbox table: several named handlers per event type (DESIGN invariant 28).

The subscriptions are rows of ``<table>_subscription`` (migration 0011), which the producers'
insert reads to fan an event out: one delivery row per live subscription, its ``event_type``
the route ``<event_type>@<name>``. Workers add the subscriptions their handlers declare at
start-up (:func:`register`); operators list, add (optionally replaying retained history) and
remove them (``outbox-celery subscriptions``). SQL in ``sql/subscriptions.sql``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, NamedTuple

import psycopg

from ..errors import AdminError
from ..handlers import subscription_route
from ..message import route, split_route
from ..table import TableName
from ._queries import many, ready, regclass, routes, value, values
from ._queries import subscription_statement as statement

__all__ = [
    "REPLAY_BATCH",
    "Added",
    "Declared",
    "Subscription",
    "add",
    "declare",
    "declared",
    "list_subscriptions",
    "register",
    "remove",
    "routes",
]

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


class Declared(NamedTuple):
    """A subscription an app declares (a handler with ``name=``), and what the table holds of it.

    ``state`` is ``added`` (by this call), ``exists`` (live already), ``removed`` (an operator
    removed it: left so, ``outbox-celery subscriptions add`` brings it back) or, from
    :func:`declared` only, ``missing``.
    """

    state: str
    event_type: str
    name: str

    @property
    def route(self) -> str:
        """``<event_type>@<name>``."""
        return route(self.event_type, self.name)


class _Row(NamedTuple):
    """A row of ``register`` and ``declared``."""

    what: str
    event_type: str
    name: str


class Added(NamedTuple):
    """What :func:`add` did: ``added`` is false when the subscription was live already."""

    route: str
    added: bool
    replayed: int


class _Fact(NamedTuple):
    """A row of ``replay_facts``: a retained fact and its producer's ordering key (``k``)."""

    id: int
    k: str | None


def _named(routes: Iterable[str]) -> dict[str, list[str]]:
    """The routes' event types and names (routes without a name left out), sorted: the
    parameters of ``register`` and ``declared``."""
    named = sorted({(t, n) for t, n in map(split_route, routes) if n is not None})
    return {"event_types": [t for t, _ in named], "names": [n for _, n in named]}


def declare(conn: psycopg.Connection[Any], table: str | TableName, routes: Iterable[str]) -> list[Declared]:
    """Add the subscriptions among ``routes`` (an app's handler keys) that the table lacks, and
    say what each is now (:class:`Declared`), by route. Idempotent: a deploy step
    (``outbox-celery migrate -A``, ``subscriptions sync``) and every worker at start-up run it.

    Routes without a name are ignored. One an operator removed stays removed. Raises
    :class:`~outbox_celery.errors.AdminError` when the table is not migrated to 0011.
    """
    params = _named(routes)
    if not params["names"]:
        return []
    if not ready(conn, table):
        raise AdminError(f"outbox table {table} has no subscription table: run outbox-celery migrate")
    return [
        Declared(r.what, r.event_type, r.name) for r in many(conn, statement(table, "register"), params, _Row)
    ]


def declared(conn: psycopg.Connection[Any], table: str | TableName, routes: Iterable[str]) -> list[Declared]:
    """What :func:`declare` would find, changing nothing: each declared subscription ``exists``,
    is ``removed`` or is ``missing`` (all of them on a table not migrated to 0011)."""
    params = _named(routes)
    if not ready(conn, table):
        pairs = zip(params["event_types"], params["names"], strict=True)
        return [Declared("missing", t, n) for t, n in pairs]
    if not params["names"]:
        return []
    return [
        Declared(r.what, r.event_type, r.name) for r in many(conn, statement(table, "declared"), params, _Row)
    ]


def register(conn: psycopg.Connection[Any], table: str | TableName, routes: Iterable[str]) -> list[str]:
    """Add the subscriptions among ``routes`` (a worker's handler keys) that the table lacks.

    Routes without a name are ignored. One an operator removed stays removed (logged): a worker
    does not bring it back, ``outbox-celery subscriptions add`` does. Returns the routes added.
    A table not migrated to 0011 adds nothing (logged). When none is missing (a deploy step
    added them: ``outbox-celery migrate -A``) it only reads, so a worker's role needs no
    ``INSERT`` on the subscription table then.
    """
    routes = list(routes)
    try:
        found = declared(conn, table, routes)
        if any(d.state == "missing" for d in found):
            found = declare(conn, table, routes)
    except AdminError as exc:
        logger.error("%s", exc)
        return []
    for d in found:
        if d.state == "removed":
            logger.warning(
                "subscription %s was removed by an operator: its handler receives nothing new "
                "until outbox-celery subscriptions add brings it back",
                d.route,
            )
    return [d.route for d in found if d.state == "added"]


def list_subscriptions(
    conn: psycopg.Connection[Any],
    table: str | TableName = "outbox",
    *,
    event_type: str | None = None,
    cap: int = 10_000,
) -> list[Subscription]:
    """Every subscription (removed ones too), with its unfinished rows counted up to ``cap``."""
    if not ready(conn, table):
        return []
    return many(conn, statement(table, "list"), {"event_type": event_type, "cap": cap}, Subscription)


def remove(conn: psycopg.Connection[Any], table: str | TableName, event_type: str, name: str) -> bool:
    """Remove a subscription: producers stop fanning out to it at once (their next statement).

    Its undelivered rows stay as they are, visible under their route (``stats``, dead letters,
    :func:`list_subscriptions`); a worker without the handler never claims them. Skip or purge
    them deliberately. Returns whether it was live.
    """
    _check(event_type, name)
    return bool(values(conn, statement(table, "remove"), {"event_type": event_type, "name": name}))


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
) -> Added:
    """Add (or bring back) a subscription; it receives the events whose insert statement runs
    after this commits. Returns whether it was added (false: it was live already, nothing
    changed) and the rows replayed.

    With ``replay_since``, it first receives the retained events of ``event_type`` written
    from that time (a replay): in batches of ``batch_size`` facts, each its own transaction,
    under the producers' key locks, before the subscription is live, then the facts written
    meanwhile with the add itself, in one transaction; each replayed row reads its fact's
    payload (stored once), locked against the retention purge until it commits. Replaying
    again writes nothing twice. A replay for a subscription that is live already (a worker
    added it) writes its rows after the ones it has: its ordered events of a key then come
    after the live ones. ``conn`` must then not be inside a transaction.
    """
    _check(event_type, name)
    if not ready(conn, table):
        raise AdminError(f"outbox table {table} has no subscription table: run outbox-celery migrate")
    replayed = 0
    if replay_since is not None:
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            raise AdminError("a replay runs its own transactions: call it outside a transaction")
        bound = int(value(conn, statement(table, "replay_until")) or 0)
        replayed, last = _replay(conn, table, event_type, name, replay_since, 0, bound, batch_size)
        with conn.transaction():
            added = _add_row(conn, table, event_type, name)
            replayed += _replay(conn, table, event_type, name, replay_since, last, None, None)[0]
    else:
        added = _add_row(conn, table, event_type, name)
    return Added(route(event_type, name), added, replayed)


def _add_row(conn: psycopg.Connection[Any], table: str | TableName, event_type: str, name: str) -> bool:
    """Add the subscription's row, or bring it back; false when it was live already."""
    return bool(values(conn, statement(table, "add"), {"event_type": event_type, "name": name}))


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
            facts = many(conn, statement(t, "replay_facts"), params, _Fact)
            if not facts:
                return total, after
            keys = sorted({f.k for f in facts if f.k})
            if keys:
                conn.execute(statement(t, "lock_keys"), {"table": table_regclass, "keys": keys})
            ids = [int(f.id) for f in facts]
            total += len(values(conn, statement(t, "replay_insert"), {**params, "ids": ids}))
            after = ids[-1]
        if batch_size is None or len(facts) < limit:
            return total, after
