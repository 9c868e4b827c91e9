"""Outbox handlers: run in a Celery worker, outside any transaction, at least once."""

from __future__ import annotations

import logging

from shop.celery import outbox

from outbox_celery import Message, PermanentError

logger = logging.getLogger(__name__)


@outbox.handler("order.placed")
def send_confirmation(message: Message) -> None:
    """ "Send" the confirmation e-mail, then record it (idempotent: a redelivery changes nothing)."""
    from django.utils import timezone

    from .models import Order

    order_id, total = message.payload["order_id"], message.payload["total"]
    if total <= 0:  # the example's way of showing a dead message in the admin
        raise PermanentError(f"order {order_id} has a total of {total}: the mail service refuses it")
    sent = Order.objects.filter(pk=order_id, confirmation_sent_at__isnull=True).update(
        confirmation_sent_at=timezone.now()
    )
    logger.info("confirmation for order %s: %s", order_id, "sent" if sent else "already sent")
