"""Progress and summary of a demo run, read from PostgreSQL (never from the demo's own counters).

A run is identified by the ``source`` its orders carry; every number below is scoped to the
events of those orders and to what the receiver recorded for them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from examples.orders import settings
from outbox_celery import Store

__all__ = ["EVENTS_PER_ORDER", "RECEIPT_ROUTE", "Check", "Snapshot", "checks", "snapshot"]

EVENTS_PER_ORDER = 7
"""Outbox rows per order: created + status, paid (to its two subscriptions) + status, shipped +
status."""

RECEIPT_ROUTE = "order.paid@receipt"
"""The subscription that writes receipts in the orders database; every other row goes to the
webhook, whose receiver records its idempotency key."""

# The run's order ids first (index on orders.source), then the outbox rows of those orders: a
# hashed "= ANY(array)" filter stays linear however stale the planner's statistics are (the
# tables grow from empty during the run).
_RUN_ORDERS = "SELECT coalesce(array_agg(id ORDER BY id), '{}') FROM orders WHERE source = %(source)s"

_OUTBOX = """
SELECT
    count(*) AS events,
    count(*) FILTER (WHERE status = 'done') AS done,
    count(*) FILTER (WHERE status = 'pending') AS pending,
    count(*) FILTER (WHERE status = 'processing') AS processing,
    count(*) FILTER (WHERE status = 'dead') AS dead,
    count(*) FILTER (WHERE attempts > 1) AS retried,
    coalesce(sum(attempts), 0) AS attempts,
    -- Every claim bumps lease_version; every handler run counts an attempt except a Defer, whose
    -- attempt is refunded. A row with more claims than attempts was deferred (a claimed row not
    -- started yet has one claim more: it is not counted until it ran).
    count(*) FILTER (WHERE lease_version > attempts + (status = 'processing')::int) AS deferred,
    coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending')), 0)::float8
        AS oldest_pending,
    -- from the first event written to the last one delivered (database clock)
    coalesce(extract(epoch FROM max(done_at) - min(created_at)), 0)::float8 AS seconds
FROM {outbox}
WHERE aggregate_type = 'order' AND aggregate_id = ANY(%(aids)s::text[])
"""

_BY_TYPE = """
SELECT event_type, count(*) FROM {outbox}
WHERE aggregate_type = 'order' AND aggregate_id = ANY(%(aids)s::text[])
GROUP BY event_type ORDER BY event_type
"""

# Delivered events whose idempotency key the receiver's inbox does not hold (must be 0).
_MISSING_FROM_INBOX = """
SELECT count(*) FROM {outbox} AS o
WHERE o.aggregate_type = 'order' AND o.aggregate_id = ANY(%(aids)s::text[]) AND o.status = 'done'
  AND o.event_type <> %(receipt_route)s
  AND NOT EXISTS (SELECT 1 FROM receiver.webhook_inbox AS i WHERE i.idempotency_key = %(key_prefix)s || o.id)
"""

# The receipts of the run's orders: exactly one per paid order, for its total, written by the
# delivery that is done (the transactional handler's insert commits with its done).
_RECEIPTS = """
SELECT
    (SELECT count(*) FROM orders WHERE id = ANY(%(ids)s) AND paid_at IS NOT NULL) AS paid,
    (SELECT count(*) FROM receipts WHERE order_id = ANY(%(ids)s)) AS receipts,
    (SELECT count(*) FROM receipts AS r JOIN orders AS o ON o.id = r.order_id
     WHERE r.order_id = ANY(%(ids)s)
       AND (r.total_cents <> o.total_cents OR r.currency <> o.currency OR o.paid_at IS NULL
            OR NOT EXISTS (SELECT 1 FROM {outbox} AS x WHERE x.id = r.outbox_id AND x.status = 'done'
                           AND x.event_type = %(receipt_route)s AND x.aggregate_id = r.order_id::text)))
        AS receipts_wrong,
    (SELECT count(*) FROM {outbox} WHERE aggregate_type = 'order' AND aggregate_id = ANY(%(aids)s::text[])
     AND event_type = %(receipt_route)s AND status = 'done') AS receipts_done
"""

_RECEIVER = """
SELECT
    (SELECT count(*) FROM receiver.webhook_inbox WHERE idempotency_key IN
        (SELECT idempotency_key FROM receiver.requests WHERE order_id = ANY(%(ids)s))) AS inbox,
    (SELECT coalesce(sum(events), 0) FROM receiver.orders WHERE order_id = ANY(%(ids)s)) AS effects,
    (SELECT coalesce(sum(out_of_order), 0) FROM receiver.orders WHERE order_id = ANY(%(ids)s))
        AS out_of_order,
    (SELECT count(*) FROM receiver.orders
     WHERE order_id = ANY(%(ids)s) AND status_seq = 3 AND status = 'completed') AS completed,
    count(*) AS requests,
    count(*) FILTER (WHERE outcome IN ('applied', 'applied_dropped')) AS applied,
    count(*) FILTER (WHERE outcome = 'applied_dropped') AS dropped,
    count(*) FILTER (WHERE outcome = 'duplicate') AS duplicates,
    count(*) FILTER (WHERE outcome = 'throttled') AS throttled
FROM receiver.requests WHERE order_id = ANY(%(ids)s)
"""


@dataclass(slots=True)
class Snapshot:
    """What PostgreSQL says about one demo run at one moment."""

    orders: int = 0
    events: int = 0
    done: int = 0
    pending: int = 0
    processing: int = 0
    dead: int = 0
    retried: int = 0
    attempts: int = 0
    deferred: int = 0
    oldest_pending: float = 0.0
    seconds: float = 0.0
    done_not_in_inbox: int = 0
    by_type: dict[str, int] = field(default_factory=dict)
    inbox: int = 0
    effects: int = 0
    out_of_order: int = 0
    completed: int = 0
    requests: int = 0
    applied: int = 0
    dropped: int = 0
    duplicates: int = 0
    throttled: int = 0
    paid: int = 0
    receipts: int = 0
    receipts_wrong: int = 0
    receipts_done: int = 0

    @property
    def unfinished(self) -> int:
        """Events neither done nor dead."""
        return self.pending + self.processing

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return asdict(self)


def snapshot(conn: psycopg.Connection[Any], source: str, *, full: bool = False) -> Snapshot:
    """Read the run's numbers; ``full`` adds the per-type counts and the inbox cross-check."""
    outbox = sql.Identifier(settings.OUTBOX_TABLE)
    with conn.cursor(row_factory=dict_row) as cur, conn.transaction():
        # One snapshot for every query: the numbers agree with each other.
        cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        first = cur.execute(_RUN_ORDERS, {"source": source}).fetchone()
        ids: list[int] = list(first["coalesce"]) if first else []
        params = {
            "ids": ids,
            "aids": [str(i) for i in ids],
            "key_prefix": Store(settings.OUTBOX_TABLE).key_prefix(conn),
            "receipt_route": RECEIPT_ROUTE,
        }
        row = cur.execute(sql.SQL(_OUTBOX).format(outbox=outbox), params).fetchone()
        receiver = cur.execute(_RECEIVER, params).fetchone()
        receipts = cur.execute(sql.SQL(_RECEIPTS).format(outbox=outbox), params).fetchone()
        snap = Snapshot(orders=len(ids))
        if full:
            types = cur.execute(sql.SQL(_BY_TYPE).format(outbox=outbox), params).fetchall()
            snap.by_type = {r["event_type"]: int(r["count"]) for r in types}
            missing = cur.execute(sql.SQL(_MISSING_FROM_INBOX).format(outbox=outbox), params).fetchone()
            snap.done_not_in_inbox = int(missing["count"]) if missing else 0
    assert row is not None and receiver is not None and receipts is not None
    for name, value in {**row, **receiver, **receipts}.items():
        setattr(snap, name, float(value) if name in ("oldest_pending", "seconds") else int(value))
    return snap


@dataclass(frozen=True, slots=True)
class Check:
    """One verdict of the summary."""

    ok: bool
    text: str


def checks(snap: Snapshot, expected_orders: int) -> list[Check]:
    """What must hold at the end of a complete run."""
    expected_events = expected_orders * EVENTS_PER_ORDER
    return [
        Check(
            snap.orders == expected_orders and snap.events == expected_events,
            f"{snap.orders}/{expected_orders} orders and {snap.events}/{expected_events} events written",
        ),
        Check(
            snap.done == snap.events and snap.dead == 0,
            f"{snap.done}/{snap.events} events delivered, {snap.dead} dead",
        ),
        Check(
            snap.inbox == snap.done - snap.receipts_done and snap.done_not_in_inbox == 0,
            f"{snap.inbox} idempotency keys in the receiver's inbox for "
            f"{snap.done - snap.receipts_done} events delivered to the webhook",
        ),
        Check(
            snap.effects == snap.inbox,
            f"{snap.effects} effects applied for {snap.inbox} inbox keys (redeliveries: no second effect)",
        ),
        Check(
            snap.out_of_order == 0 and snap.completed == expected_orders,
            f"status changes out of sequence: {snap.out_of_order}; "
            f"{snap.completed}/{expected_orders} orders completed in the receiver's view",
        ),
        Check(
            snap.receipts == snap.paid == expected_orders
            and snap.receipts_done == snap.receipts
            and snap.receipts_wrong == 0,
            f"{snap.receipts} receipts for {snap.paid} paid orders ({RECEIPT_ROUTE}: "
            f"{snap.receipts_done} delivered, {snap.receipts_wrong} wrong)",
        ),
    ]
