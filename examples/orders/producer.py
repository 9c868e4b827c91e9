"""The write side of the orders service: every change and its events in one transaction.

This is the whole point of the outbox: ``INSERT INTO orders`` (or ``UPDATE``) and the
``outbox_celery.enqueue_many`` of its events commit together or not at all. Nothing is
published here; the outbox's claim task picks the rows up after commit.

Events of one order:

``order.created``, ``order.paid``, ``order.shipped``
    unordered; ``order.shipped`` is only delivered once the order is paid (its handler defers).
``order.status_changed``
    ordered per order (``ordered=True``: key ``order:<id>``), carrying ``seq`` 1, 2, 3... so the
    receiver can check it saw them in sequence.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from outbox_celery import Event, enqueue_many

from . import settings

__all__ = ["OrderError", "create_order", "get_order", "pay_order", "ship_order"]


class OrderError(Exception):
    """A business rule refused the change (unknown order, paid twice...).

    :ivar status: the HTTP status the API answers with.
    """

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


def _status_event(order_id: int, status: str, seq: int) -> Event:
    return Event(
        "order.status_changed",
        {"order_id": order_id, "status": status, "seq": seq},
        aggregate_type="order",
        aggregate_id=order_id,
        ordered=True,
    )


def create_order(
    conn: psycopg.Connection[Any],
    *,
    customer: str,
    total_cents: int,
    currency: str = "EUR",
    source: str = "api",
) -> int:
    """Insert an order and its ``order.created`` + ``order.status_changed`` events; return its id."""
    if not isinstance(customer, str) or not customer.strip():
        raise OrderError("customer must be a non-empty string", 400)
    if isinstance(total_cents, bool) or not isinstance(total_cents, int) or total_cents < 0:
        raise OrderError("total_cents must be a non-negative integer", 400)
    with conn.transaction():
        row = conn.execute(
            "INSERT INTO orders (customer, total_cents, currency, source) VALUES (%s, %s, %s, %s)"
            " RETURNING id, created_at",
            [customer, total_cents, currency, source],
        ).fetchone()
        assert row is not None
        order_id, created_at = int(row[0]), row[1]
        created = {
            "order_id": order_id,
            "customer": customer,
            "total_cents": total_cents,
            "currency": currency,
            "created_at": created_at.isoformat(),
        }
        enqueue_many(
            conn,
            [
                Event("order.created", created, aggregate_type="order", aggregate_id=order_id),
                _status_event(order_id, "created", 1),
            ],
            table=settings.OUTBOX_TABLE,
        )
    return order_id


def _change(conn: psycopg.Connection[Any], order_id: int, action: str) -> tuple[str, int, datetime]:
    # The row lock taken by UPDATE serializes changes of one order; the enqueue's ordering-key
    # lock then keeps id order equal to commit order for its status events.
    column, other = ("paid_at", "shipped_at") if action == "paid" else ("shipped_at", "paid_at")
    query = sql.SQL(
        "UPDATE orders SET {column} = now(), status_seq = status_seq + 1,"
        " status = CASE WHEN {other} IS NULL THEN %s ELSE 'completed' END"
        " WHERE id = %s AND {column} IS NULL"
        " RETURNING status, status_seq, {column}"
    ).format(column=sql.Identifier(column), other=sql.Identifier(other))
    row = conn.execute(query, [action, order_id]).fetchone()
    if row is None:
        exists = conn.execute("SELECT 1 FROM orders WHERE id = %s", [order_id]).fetchone()
        if exists is None:
            raise OrderError(f"order {order_id} does not exist", 404)
        raise OrderError(f"order {order_id} is already {action}", 409)
    return str(row[0]), int(row[1]), row[2]


def pay_order(conn: psycopg.Connection[Any], order_id: int) -> str:
    """Record the payment; emit ``order.paid`` and ``order.status_changed``. Return the status."""
    with conn.transaction():
        status, seq, paid_at = _change(conn, order_id, "paid")
        enqueue_many(
            conn,
            [
                Event(
                    "order.paid",
                    {"order_id": order_id, "paid_at": paid_at.isoformat()},
                    aggregate_type="order",
                    aggregate_id=order_id,
                ),
                _status_event(order_id, status, seq),
            ],
            table=settings.OUTBOX_TABLE,
        )
    return status


def ship_order(conn: psycopg.Connection[Any], order_id: int, *, carrier: str = "parcelco") -> str:
    """Record the shipment; emit ``order.shipped`` and ``order.status_changed``. Return the status.

    Shipping before payment is allowed (invoice customers): the customer notification
    (``order.shipped``) then waits until the order is paid.
    """
    with conn.transaction():
        status, seq, shipped_at = _change(conn, order_id, "shipped")
        enqueue_many(
            conn,
            [
                Event(
                    "order.shipped",
                    {
                        "order_id": order_id,
                        "carrier": carrier,
                        "tracking": f"{carrier.upper()}-{order_id:08d}",
                        "shipped_at": shipped_at.isoformat(),
                    },
                    aggregate_type="order",
                    aggregate_id=order_id,
                ),
                _status_event(order_id, status, seq),
            ],
            table=settings.OUTBOX_TABLE,
        )
    return status


def get_order(conn: psycopg.Connection[Any], order_id: int) -> dict[str, Any]:
    """The order and the delivery state of each of its events (read from the outbox)."""
    with conn.cursor(row_factory=dict_row) as cur:
        order = cur.execute(
            "SELECT id, customer, total_cents, currency, status, status_seq, source, created_at,"
            " paid_at, shipped_at FROM orders WHERE id = %s",
            [order_id],
        ).fetchone()
        if order is None:
            raise OrderError(f"order {order_id} does not exist", 404)
        events = cur.execute(
            sql.SQL(
                "SELECT id, event_type, status, attempts, last_error, created_at, done_at FROM {}"
                " WHERE aggregate_type = 'order' AND aggregate_id = %s ORDER BY id"
            ).format(sql.Identifier(settings.OUTBOX_TABLE)),
            [str(order_id)],
        ).fetchall()
    order["events"] = events
    return order
