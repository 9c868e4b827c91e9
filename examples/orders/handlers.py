"""Outbox handlers of the orders service: deliver ``order.*`` events to the webhook, and write
each paid order's receipt.

``order.paid`` has two subscriptions (docs/subscriptions.md): ``webhook`` tells the receiver and
``receipt`` writes the receipt in the orders database, each with its own queue, attempts and
dead letters. The webhook handlers run in a Celery worker, outside any transaction, after the
outbox's fenced start; they return when delivered or raise what should happen next (see
:mod:`.webhook`). The receipt handler is transactional: its insert commits with its ``done``.
"""

from __future__ import annotations

from typing import Any

import psycopg

from outbox_celery import Defer, Message, PermanentError

from . import settings
from .app import outbox
from .webhook import post_event

__all__ = ["SHIP_DEFER_SECONDS"]

# The receiver accepts about 100 requests a second (the demo's --max-rate) and answers 429 beyond.
# Each webhook event type declares its share (rate=: at most that many start a second across every
# worker, enforced by the claim), so the 429s stay rare; one that still comes holds its event type
# back for Retry-After on every worker (RateLimited, in webhook.post_event).
SHIP_DEFER_SECONDS = 1.0
"""How long ``order.shipped`` waits before looking again for the payment (short for the demo)."""


@outbox.handler("order.created", queue=settings.WEBHOOKS_QUEUE, rate="25/s")
def deliver_order_created(message: Message) -> None:
    """Tell the webhook about a new order."""
    post_event(message)


@outbox.handler("order.paid", name="webhook", queue=settings.WEBHOOKS_QUEUE, rate="25/s")
def deliver_order_paid(message: Message) -> None:
    """Tell the webhook an order was paid (the subscription ``order.paid@webhook``)."""
    post_event(message)


@outbox.handler("order.paid", name="receipt", queue=settings.LEDGER_QUEUE, transactional=True)
def write_receipt(message: Message, conn: psycopg.Connection[Any]) -> None:
    """Write the paid order's receipt (the subscription ``order.paid@receipt``): the insert and
    the outbox's ``done`` commit together, so a receipt exists exactly when its delivery is
    done; one per order (a replayed event finds it and writes nothing)."""
    order_id = int(message.payload["order_id"])
    row = conn.execute(
        "INSERT INTO receipts (order_id, total_cents, currency, outbox_id)"
        " SELECT id, total_cents, currency, %s FROM orders WHERE id = %s AND paid_at IS NOT NULL"
        " ON CONFLICT (order_id) DO NOTHING RETURNING order_id",
        [message.id, order_id],
    ).fetchone()
    if (
        row is None
        and conn.execute("SELECT 1 FROM receipts WHERE order_id = %s", [order_id]).fetchone() is None
    ):
        raise PermanentError(f"order {order_id} does not exist or is not paid")


@outbox.handler("order.status_changed", queue=settings.WEBHOOKS_QUEUE, rate="60/s")
def deliver_status_changed(message: Message) -> None:
    """Status changes are ordered per order (enqueued with ``ordered=True``): the outbox hands
    out the next one only when this one is done, so the receiver sees ``seq`` 1, 2, 3."""
    post_event(message)


@outbox.handler("order.shipped", queue=settings.FULFILMENT_QUEUE, rate="25/s")
def deliver_order_shipped(message: Message) -> None:
    """The shipping notification goes out only for paid orders: a business "not yet" is a
    ``Defer`` (no attempt spent), not an error."""
    order_id = int(message.aggregate_id)
    with outbox.connection() as conn:
        row = conn.execute("SELECT paid_at FROM orders WHERE id = %s", [order_id]).fetchone()
    if row is None:
        raise PermanentError(f"order {order_id} does not exist")
    if row[0] is None:
        raise Defer(SHIP_DEFER_SECONDS, f"order {order_id} is not paid yet")
    post_event(message)
