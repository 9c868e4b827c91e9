"""Outbox handlers of the orders service: deliver ``order.*`` events to the webhook.

Each handler runs in a Celery worker, outside any transaction, after the outbox's fenced start;
it returns when delivered or raises what should happen next (see :mod:`.webhook`).
"""

from __future__ import annotations

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


@outbox.handler("order.paid", queue=settings.WEBHOOKS_QUEUE, rate="25/s")
def deliver_order_paid(message: Message) -> None:
    """Tell the webhook an order was paid."""
    post_event(message)


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
