"""Flow control by hand: pause and resume event types and limit keys (DESIGN invariants 23, 24).

What ``outbox-celery pause`` and ``resume`` run, what ``stats`` lists as paused or held, and the
pruning of per-key flow state that the retention task runs. The state lives in the table's
flow-control rows (``<table>_flow``, migration 0007; ``<table>_flow_key``, migration 0008), which
every claim reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import psycopg

from ..db import statements as _sql
from ..errors import AdminError
from ..table import TableName
from ._queries import many, one, outside_transaction, q, regclass, value
from ._queries import routes as subscription_routes

__all__ = [
    "FlowState",
    "KeyFlowState",
    "flow_states",
    "flow_targets",
    "key_states",
    "pause",
    "prune_flow_keys",
    "resume",
]


@dataclass(frozen=True, slots=True)
class FlowState:
    """An event type the claims hold back (DESIGN invariant 23).

    :ivar paused: paused by an operator (:func:`pause`) until :func:`resume`.
    :ivar held_for: seconds a :class:`~outbox_celery.errors.RateLimited` outcome still holds it
        (``None``: not held).
    """

    event_type: str
    paused: bool
    held_for: float | None


@dataclass(frozen=True, slots=True)
class KeyFlowState:
    """A limit key the claims hold back (DESIGN invariant 24).

    :ivar paused: paused by an operator (:func:`pause` with ``limit_key``) until resumed.
    :ivar held_for: seconds a :class:`~outbox_celery.errors.RateLimited` outcome of one of its
        messages still holds it (``None``: not held).
    """

    event_type: str
    limit_key: str
    paused: bool
    held_for: float | None


class _Paused(NamedTuple):
    """A row of ``flow_pause`` and ``flow_key_pause``."""

    was_paused: bool
    rows: int


class _Resumed(NamedTuple):
    """A row of ``flow_resume`` and ``flow_key_resume``."""

    was_held: bool
    rows: int
    woke: bool | None


def _held(seconds: float | None) -> float | None:
    """Seconds a hold has left, ``None`` when it is over or there is none."""
    return None if seconds is None or seconds <= 0 else float(seconds)


def _flow_state(*, event_type: str, paused: bool, held_for: float | None) -> FlowState:
    return FlowState(str(event_type), bool(paused), _held(held_for))


def _key_flow_state(*, event_type: str, limit_key: str, paused: bool, held_for: float | None) -> KeyFlowState:
    return KeyFlowState(str(event_type), str(limit_key), bool(paused), _held(held_for))


def _flow_ready(conn: psycopg.Connection[Any], t: TableName) -> bool:
    name = t.identifier(_sql.FLOW_SUFFIX).as_string(conn)
    return bool(value(conn, q(t, "flow_exists"), {"flow_table": name}))


def _flow_keys_ready(conn: psycopg.Connection[Any], t: TableName) -> bool:
    name = t.identifier(_sql.FLOW_KEY_SUFFIX).as_string(conn)
    return bool(value(conn, q(t, "flow_keys_exist"), {"flow_key_table": name}))


def _flow_key_prunable(conn: psycopg.Connection[Any], t: TableName) -> bool:
    """Whether migration 0009 (the buckets' ``full_at``) is applied."""
    name = t.identifier(_sql.FLOW_KEY_SUFFIX).as_string(conn)
    return bool(value(conn, q(t, "flow_key_full_at_exists"), {"flow_key_table": name}))


def flow_states(conn: psycopg.Connection[Any], table: str | TableName = "outbox") -> list[FlowState]:
    """Event types paused or held by a RateLimited outcome (empty before migration 0007)."""
    t = TableName.parse(table)
    if not _flow_ready(conn, t):
        return []
    return many(conn, q(t, "flow_list"), None, _flow_state)


def key_states(conn: psycopg.Connection[Any], table: str | TableName = "outbox") -> list[KeyFlowState]:
    """Limit keys paused or held by a RateLimited outcome (empty before migration 0008)."""
    t = TableName.parse(table)
    if not _flow_keys_ready(conn, t):
        return []
    return many(conn, q(t, "flow_key_list"), None, _key_flow_state)


def _event_type(event_type: str) -> str:
    if not isinstance(event_type, str) or not event_type:
        raise AdminError(f"invalid event type {event_type!r}: expected a non-empty string")
    return event_type


def _limit_key(limit_key: str) -> str:
    if not isinstance(limit_key, str) or not limit_key:
        raise AdminError(f"invalid limit key {limit_key!r}: expected a non-empty string")
    return limit_key


def pause(
    conn: psycopg.Connection[Any], table: str | TableName, event_type: str, *, limit_key: str | None = None
) -> bool:
    """Pause ``event_type`` (docs/flow-control.md, DESIGN invariant 23), or only its
    ``limit_key`` (DESIGN invariant 24: the type's other keys flow on).

    From the next claim on (every claim reads the pause under its row's lock) no claim hands out
    its messages, on any worker; deliveries already running finish. An event type with no
    message yet can be paused too. An event type with subscriptions (DESIGN invariant 28) is
    paused with every route of it (:func:`flow_targets`), in one transaction; a route
    (``order.paid@receipt``) alone pauses that subscription. Returns whether it was running
    (``False``: paused already, every route of it too).
    """
    t = TableName.parse(table)
    with conn.transaction():
        running = False
        for target in flow_targets(conn, t, event_type):
            if limit_key is not None:
                params = {"event_type": target, "limit_key": _limit_key(limit_key)}
                row = one(conn, q(t, "flow_key_pause"), params, _Paused)
            else:
                row = one(conn, q(t, "flow_pause"), {"event_type": target}, _Paused)
            running |= not (row is not None and bool(row.was_paused))
    return running


def resume(
    conn: psycopg.Connection[Any], table: str | TableName, event_type: str, *, limit_key: str | None = None
) -> bool:
    """Resume ``event_type`` (or only its ``limit_key``): its pause and any RateLimited hold on
    it end, and the table's push listeners are woken at commit, so its messages are claimed at
    once. An event type with subscriptions is resumed with every route of it, as :func:`pause`
    paused them. Returns whether it (or any route of it) was paused or held.
    """
    t = TableName.parse(table)
    with conn.transaction():
        held = False
        for target in flow_targets(conn, t, event_type):
            params: dict[str, Any] = {"event_type": target, "table": regclass(conn, t)}
            if limit_key is not None:
                params["limit_key"] = _limit_key(limit_key)
                row = one(conn, q(t, "flow_key_resume"), params, _Resumed)
            else:
                row = one(conn, q(t, "flow_resume"), params, _Resumed)
            held |= row is not None and bool(row.was_held)
    return held


def flow_targets(conn: psycopg.Connection[Any], table: str | TableName, event_type: str) -> list[str]:
    """What pausing or resuming ``event_type`` reaches: the type, then the routes of its
    subscriptions (removed ones too: a worker with the handler still claims their rows); a
    route (``order.paid@receipt``) or a type without subscriptions is itself alone (DESIGN
    invariants 23 and 28)."""
    return [_event_type(event_type), *subscription_routes(conn, table, event_type)]


def prune_flow_keys(
    conn: psycopg.Connection[Any],
    table: str | TableName = "outbox",
    *,
    batch_size: int = 5000,
    max_batches: int | None = None,
) -> int:
    """Delete the per-key flow state that is worth nothing any more; return rows deleted.

    A row of ``<table>_flow_key`` whose key is neither paused nor held, whose ``key_rate``
    bucket is full again (or that never had one) and that nothing touched for a minute says
    nothing an absent row does not (DESIGN invariant 25): the table stays the size of the keys
    paused, held or recently rate limited, not of every key ever seen.
    :func:`~outbox_celery.ops.retention.purge_done` (the retention task, ``outbox-celery
    purge``) runs it. Batches of ``batch_size``, each its own short transaction, so ``conn``
    must not be inside a transaction. Nothing before migration 0009.
    """
    outside_transaction(conn, "prune")
    t = TableName.parse(table)
    if not _flow_keys_ready(conn, t) or not _flow_key_prunable(conn, t):
        return 0
    query = q(t, "flow_keys_prune")
    total = batches = 0
    while max_batches is None or batches < max_batches:
        with conn.transaction():
            n = conn.execute(query, {"limit": batch_size}).rowcount
        total += n
        batches += 1
        if n < batch_size:
            break
    return total
